# What the elastic snippet of the documentation leaves out: a model, data, a training step.
import torch

epochs = 2
dataset = torch.utils.data.TensorDataset(torch.randn(200, 8), torch.randint(0, 2, (200,)))


def make_model():
    return torch.nn.Linear(8, 2)


def step(batch):
    x, y = batch
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
