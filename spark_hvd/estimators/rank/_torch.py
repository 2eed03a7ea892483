"""The rank side of TorchEstimator: the training loop each Spark task's rank runs, and the
tensor helpers the driver and ``TorchModel.transform``'s predictor share with it. Kept free of
PySpark imports so that a rank starts fast."""

from __future__ import annotations

import io

import cloudpickle


def bytes_io(data: bytes = b""):
    return io.BytesIO(data)


def as_tensor(array, device=None):
    """A batch column as the model gets it: floating point in torch's default dtype (what
    modules' parameters are; Spark's doubles would not match them), integers as int64 (what
    class-index losses want), bool unchanged."""
    import numpy as np
    import torch
    if not array.flags.writeable:   # Arrow memory is read-only; torch wants writable arrays
        array = array.copy()
    tensor = torch.from_numpy(array)
    if tensor.is_floating_point():
        tensor = tensor.to(torch.get_default_dtype())
    elif array.dtype != np.bool_:
        tensor = tensor.long()
    return tensor if device is None else tensor.to(device)


def _rebuild_optimizer(blob, model):
    cls, defaults, state = cloudpickle.loads(blob)
    optimizer = cls(model.parameters(), **defaults)
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as error:
        raise ValueError("the optimizer's parameter groups do not match the model's parameters "
                         "(build it with optimizer_class(model.parameters(), ...)): "
                         f"{error}") from error
    return optimizer


def _metric_name(metric) -> str:
    return getattr(metric, "__name__", None) or type(metric).__name__


def _loss_functions(config):
    loss = cloudpickle.loads(config["loss"])
    constructors = cloudpickle.loads(config["loss_constructors"])
    if constructors is not None:
        return [c() for c in constructors]
    return list(loss) if isinstance(loss, (list, tuple)) else [loss]


def _unreduced(loss_fn):
    """``loss_fn`` giving per-row losses (for sample weights)."""
    import copy

    import torch
    if isinstance(loss_fn, torch.nn.Module) and hasattr(loss_fn, "reduction"):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        return unreduced
    return lambda output, label: loss_fn(output, label, reduction="none")


def _make_loss(loss_fns, loss_weights):
    """The training loss, Horovod's way: the losses of several labels weighted by
    ``loss_weights`` (default: 1/number of labels, their mean); with sample weights each row's
    loss is multiplied by its weight and the batch's mean taken (not a weighted average: a
    row's weight then counts the same whichever batch it falls in)."""
    weights = list(loss_weights) if loss_weights is not None else \
        [1.0 / len(loss_fns)] * len(loss_fns)
    if len(weights) != len(loss_fns):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(loss_fns)} losses")
    unreduced = [None] * len(loss_fns)

    def loss(outputs, labels, sample_weights=None):
        if len(outputs) != len(loss_fns) and len(loss_fns) == 1:
            raise ValueError(f"the model returns {len(outputs)} outputs but one loss was given; "
                             "pass one loss per label column")
        total = 0
        for i, (fn, w, out, label) in enumerate(zip(loss_fns, weights, outputs, labels)):
            if sample_weights is None:
                value = fn(out, label)
            else:
                if unreduced[i] is None:
                    unreduced[i] = _unreduced(fn)
                rows = unreduced[i](out, label).reshape(len(sample_weights), -1).mean(dim=1)
                value = (rows * sample_weights).mean()
            total = total + w * value
        return total
    return loss


def _default_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels,
                       sample_weights):
    outputs = model(*inputs)
    outputs, labels = transform_outputs(outputs, labels)
    loss = loss_fn(outputs, labels, sample_weights)
    loss.backward()
    optimizer.step()
    return outputs, loss


def _import_dynamo():
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - only a warm-up; the optimizer reports real problems
        pass


def select_device(torch, hvd, use_gpu: bool, note: bool = True):
    """The rank's device: with ``use_gpu`` and CUDA available, ``cuda:<local_rank % visible
    GPUs>``, which ``spark.run``'s binding makes one of the GPUs Spark gave the task (its own
    when it has one GPU); else the CPU, with one line from rank 0 if ranks given GPUs fell back
    (see :func:`_training.note_cpu_fallback`). Every rank calls it (a collective with
    ``use_gpu``; not with ``note=False``: an elastic fit's newcomer cannot call one here, so
    the fit notes at the start of each round instead)."""
    from spark_hvd.estimators.rank import _training
    on_gpu = use_gpu and torch.cuda.is_available()
    if note:
        _training.note_cpu_fallback(hvd, use_gpu, on_gpu, _training.TORCH_NO_CUDA)
    if not on_gpu:
        return torch.device("cpu")
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def train_on_rank(config, resume):
    """What each rank runs (through ``spark.run``, or ``spark.run_elastic`` when
    ``config["elastic"]``: see ``_fit_elastic``): train, checkpoint, report; rank 0 returns
    the final weights and the history."""
    import threading

    import numpy as np
    import torch

    # The first optimizer a process builds imports torch._dynamo (~2 s): do that while the
    # ranks meet in init.
    preload = threading.Thread(target=_import_dynamo, daemon=True)
    preload.start()
    import spark_hvd.torch as hvd
    from spark_hvd.estimators.data._arrays import reshape_batch
    from spark_hvd.estimators.rank import _fit_elastic, _training

    elastic = bool(config.get("elastic"))
    hvd.init()
    preload.join()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(_training.cpu_threads_per_rank())
    seed = config["random_seed"]
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    device = select_device(torch, hvd, config["use_gpu"], note=not elastic)

    model = cloudpickle.loads(config["model"]).to(device)
    optimizer = _rebuild_optimizer(config["optimizer"], model)
    base_lrs = [group["lr"] for group in optimizer.param_groups]

    def scale_learning_rate(ranks):
        if config["scale_learning_rate"]:
            for group, lr in zip(optimizer.param_groups, base_lrs):
                group["lr"] = lr * ranks

    store, run_id = config["store"], config["run_id"]
    start_epoch, history = 0, {}
    if resume is not None and rank == 0:
        state = torch.load(bytes_io(store.read_bytes(resume)), weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, history = state["epoch"] + 1, state["history"]
    scale_learning_rate(size)
    if not elastic:   # elastic: hvd.elastic.run's first sync does it, newcomers included
        start_epoch, history = hvd.broadcast_object((start_epoch, history), root_rank=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = config["gradient_compression"] or hvd.Compression.none
    passes = config["backward_passes_per_step"]
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=passes)
    loss_fn = _make_loss(_loss_functions(config), config["loss_weights"])
    metrics = config["metrics"]
    minibatch = config["train_minibatch_fn"] or _default_minibatch
    feature_cols, label_cols = config["feature_cols"], config["label_cols"]
    weight_col = config["sample_weight_col"]
    input_shapes = config["input_shapes"] or [None] * len(feature_cols)
    label_shapes = config["label_shapes"] or [None] * len(label_cols)
    transformation_fn = config["transformation_fn"]

    def tensors(batch):
        if transformation_fn is not None:
            batch = transformation_fn(batch)
        inputs = [as_tensor(reshape_batch(batch[c], s), device)
                  for c, s in zip(feature_cols, input_shapes)]
        labels = [as_tensor(reshape_batch(batch[c], s), device)
                  for c, s in zip(label_cols, label_shapes)]
        weights = (torch.from_numpy(batch[weight_col]).to(device).float()
                   if weight_col else None)
        return inputs, labels, weights

    def transform_outputs(outputs, labels):
        if not isinstance(outputs, (list, tuple)):
            outputs = [outputs]
        return list(outputs), labels

    def metric_values(outputs, labels, prefix=""):
        values = {}
        for metric in metrics:
            values[prefix + _metric_name(metric)] = float(metric(outputs[0], labels[0]))
        return values

    epochs = config["epochs"]
    view = _fit_elastic.RankView(config, rank, size, history,
                                 on_place=scale_learning_rate if elastic else None)
    callbacks = config["callbacks"]
    _training.call_hooks(callbacks, "on_train_begin", model=model, optimizer=optimizer)

    def train_epoch(epoch):
        train_reader, val_reader, reporter = view.train, view.val, view.reporter
        model.train()
        steps = train_reader.steps_per_epoch
        reporter.start(epoch, steps)
        _training.call_hooks(callbacks, "on_epoch_begin", epoch)
        sums = _training.MeanAccumulator()
        for step, batch in enumerate(train_reader.epoch(epoch)):
            inputs, labels, weights = tensors(batch)
            if step % passes == 0:
                optimizer.zero_grad()
            outputs, loss = minibatch(model, optimizer, transform_outputs, loss_fn, inputs,
                                      labels, weights)
            outputs, labels = transform_outputs(outputs, labels)
            loss_value = loss.item()
            with torch.no_grad():
                sums.add({"loss": loss_value, **metric_values(outputs, labels)})
            reporter.step(1, loss_value)
        if val_reader is not None:
            model.eval()
            with torch.no_grad():
                for batch in val_reader.epoch(epoch):
                    inputs, labels, weights = tensors(batch)
                    outputs, labels = transform_outputs(model(*inputs), labels)
                    sums.add({"val_loss": float(loss_fn(outputs, labels, weights)),
                              **metric_values(outputs, labels, "val_")})
        averaged = _average_epoch(hvd, sums, steps,
                                  val_reader.steps_per_epoch if val_reader else 0)
        rows = steps * config["batch_size"] * view.size
        reporter.end(epoch, averaged, rows)
        _training.call_hooks(callbacks, "on_epoch_end", epoch, dict(averaged))
        if view.rank == 0:
            state = {"epoch": epoch, "model": model.state_dict(),
                     "optimizer": optimizer.state_dict(), "history": reporter.history}
            buffer = bytes_io(b"")
            torch.save(state, buffer)
            _training.save_checkpoint(store, run_id, epoch, buffer.getvalue(), "pt")

    try:
        if elastic:
            def on_round():
                _training.note_cpu_fallback(hvd, config["use_gpu"], device.type == "cuda",
                                            _training.TORCH_NO_CUDA)
            _fit_elastic.train_epochs(hvd, model, optimizer, view, start_epoch, epochs,
                                      train_epoch, on_round=on_round)
        else:
            for epoch in range(start_epoch, epochs):
                train_epoch(epoch)
    finally:
        view.close()
    _training.call_hooks(callbacks, "on_train_end")
    if hvd.rank() != 0:
        return None
    buffer = bytes_io(b"")
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    # The trained optimizer state too: TorchModel.getOptimizer() returns it (Horovod's API).
    optimizer_buffer = bytes_io(b"")
    torch.save(optimizer.state_dict(), optimizer_buffer)
    return {"model_state": buffer.getvalue(), "optimizer_state": optimizer_buffer.getvalue(),
            "history": view.reporter.history}


def _average_epoch(hvd, sums, train_steps, val_steps):
    """Per-step means of this rank's epoch, then averaged over the ranks (one allreduce)."""
    import torch
    names = sorted(sums.sums)
    means = [sums.sums[n] / max(1, val_steps if n.startswith("val_") else train_steps)
             for n in names]
    averaged = hvd.allreduce(torch.tensor(means, dtype=torch.float64), op=hvd.Average,
                             name="spark_hvd.estimator.epoch_metrics")
    return dict(zip(names, averaged.tolist()))
