# What the PyTorch snippets of the documentation leave out: a small model and data.
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(x)


_data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
loader = torch.utils.data.DataLoader(_data, batch_size=16)
loss_fn = torch.nn.functional.cross_entropy
