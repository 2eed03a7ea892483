"""Gradient rules every framework adapter follows, written once: how ``DistributedOptimizer``
arguments are checked and turned into reduction parameters, how parameters are named and
grouped for allreduce, and the gradients of the differentiable collectives. They are Horovod's
rules, error messages included, so a migrated script behaves the same under torch and TF."""

import warnings

from ._errors import UnsupportedError
from ._ops import Adasum, Average, Sum


def check_adasum_size(op, set_size):
    """Adasum combines ranks pairwise as a binary tree: the set needs 1, 2, 4, 8 ... ranks.
    Checked when the optimizer is built rather than at the first allreduce in backward, and
    before a TF graph gets the op. ``NotImplementedError`` (and ``ValueError``), as Horovod."""
    if op == Adasum and set_size & (set_size - 1):
        raise UnsupportedError(f"op=Adasum needs a power-of-two number of ranks; the process "
                               f"set has {set_size} (use op=Average, or a process set of 2, 4, "
                               f"8 ... ranks)")


def check_optimizer_args(op, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         is_tensor=None):
    """Validates ``DistributedOptimizer`` arguments the way Horovod does; returns ``groups``
    (``num_groups`` is its deprecated spelling). ``is_tensor(x)`` checks explicit groups'
    members."""
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer supports op=Average, Sum or Adasum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in a future release.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None:
        if isinstance(groups, bool) or not (isinstance(groups, list) or
                                            (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of "
                             "tensors.")
        if isinstance(groups, list):
            seen = set()
            for group in groups:
                for p in group:
                    if is_tensor is not None and not is_tensor(p):
                        raise ValueError("groups must consist of tensors.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))
    return groups


def scale_factors(op, gradient_predivide_factor=1.0):
    """``(prescale, postscale)`` for a gradient allreduce: with op=Average the sum is split
    around the reduction as ``1/f`` before and ``f`` after (the core then divides by the set
    size), which keeps fp16 sums of many ranks in range."""
    if op == Average and gradient_predivide_factor != 1.0:
        return 1.0 / gradient_predivide_factor, float(gradient_predivide_factor)
    return 1.0, 1.0


def find_duplicates(names):
    """Names that occur more than once, in first-seen order."""
    seen, dups = set(), []
    for n in names:
        if n in seen and n not in dups:
            dups.append(n)
        seen.add(n)
    return dups


def named_parameters_of(named_parameters, all_params):
    """Checks ``named_parameters`` against the optimizer's parameters and returns
    ``{id(param): name}``. Without names, parameters are named by their position across all
    parameter groups (identical on every rank that builds the same model)."""
    if named_parameters is None:
        return {id(p): f"allreduce.noname.{i}" for i, p in enumerate(all_params)}
    named_parameters = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    dups = find_duplicates([name for name, _ in named_parameters])
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(str(d) for d in dups))
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [id(p) for p in all_params if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         "were not named. Python object ids: "
                         + ", ".join(str(i) for i in unnamed))
    return {id(p): str(name) for name, p in named_parameters}


def split_into_groups(items, num_groups):
    """Splits ``items`` into ``num_groups`` contiguous, nearly equal, non-empty chunks."""
    d, r = divmod(len(items), num_groups)
    chunks = [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(num_groups)]
    return [c for c in chunks if c]


def form_groups(params, groups, name_of):
    """Allreduce groups for ``params`` (already in the order every rank agreed on): ``groups``
    is a number of groups or explicit lists of parameters; parameters not listed in explicit
    groups travel alone."""
    if isinstance(groups, list):
        wanted = {id(p) for p in params}
        out, grouped = [], set()
        for group in groups:
            members = [p for p in group if id(p) in wanted]
            if members:
                out.append(members)
                grouped.update(id(p) for p in members)
        out += [[p] for p in params if id(p) not in grouped]
        return [tuple(g) for g in out]
    return [tuple(g) for g in split_into_groups(list(params), int(groups))]


# -- gradients of the differentiable collectives -------------------------------------------
#
# allreduce(op):          the gradient is allreduced with the same op and scale factors.
# allgather:              this rank's slice of the gradient, averaged over the ranks.
# broadcast(root):        the gradient averaged over the ranks, on the root; zero elsewhere.
# alltoall(splits):       the gradient sent back with alltoall by the received splits.
# reducescatter(op):      the gradients allgathered, times prescale x postscale, and times n
#                         for Sum (Horovod's rule: n times the exact gradient for either op,
#                         matching its convention that gradients are averaged over the ranks).

GRAD_OP_ALLGATHER = Average
GRAD_OP_BROADCAST = Average


def reducescatter_grad_scale(op, set_size, prescale=1.0, postscale=1.0):
    """The factor applied to the allgathered gradient of a reducescatter (Horovod's)."""
    scale = float(prescale) * float(postscale)
    if op == Sum:
        scale *= set_size
    return scale


def slice_offset(first_dims, index):
    """Offset of member ``index``'s rows in a concatenation of ``first_dims``."""
    return int(sum(first_dims[:index]))


# -- averaging a step's gradients -------------------------------------------------------------

def checked_local_layers(local_layers):
    """``local_layers`` (one Keras layer or a collection of them) as a list, with Horovod's
    error for anything else."""
    import keras
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return local_layers


class BaseGradientAllreducer:
    """Averages (or sums) one step's list of gradients across the ranks of a process set: the
    rules every tensor type shares (local variables stay on their rank, ``groups`` split the
    dense gradients into grouped allreduces, compression around each). A subclass supplies the
    tensor operations: :meth:`_allreduce_group`, and the sparse, dividing and tracing hooks
    where its framework has them.

    Args: as ``DistributedOptimizer``'s, plus ``set_size``, a function returning the number
    of ranks in ``process_set``.
    """

    def __init__(self, compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                 process_set, name, scale_local_gradients, set_size):
        from .process_sets import global_process_set
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.prescale, self.postscale = scale_factors(op, gradient_predivide_factor)
        self.groups = groups
        self.process_set = process_set if process_set is not None else global_process_set
        self.name = name
        self.scale_local_gradients = scale_local_gradients
        self._set_size = set_size
        # id -> variable: holding the variable keeps its id from being reused.
        self._local = {}
        # Local layers, resolved to their variables at each call: a layer of a subclassed
        # model has none until the first step builds it.
        self._local_layers = []
        self._traced = False

    # -- what a tensor type supplies ------------------------------------------------------

    def _allreduce_group(self, tensors):
        """``tensors`` (dense, already compressed) reduced together; returns a list."""
        raise NotImplementedError

    def _tracing(self):
        """True while a graph or a compiled function is being traced (not eager)."""
        return False

    def _is_sparse(self, grad):
        return False

    def _sparse_allreduce(self, grad):
        raise NotImplementedError

    def _to_dense(self, grad):
        return grad

    def _divided(self, grad, n):
        return grad / n

    def _is_variable(self, value):
        return hasattr(value, "assign")

    # -- the shared rules -------------------------------------------------------------------

    def _warn_if_traced(self):
        if self._traced:
            warnings.warn("a local variable was registered after a training step was traced: "
                          "steps traced before (model.fit's, a tf.function's) still average "
                          "it. Register local variables before the first step.", stacklevel=3)

    def register_local(self, variable):
        """Marks ``variable`` as this rank's own: its gradient is never communicated.
        Register before the first traced step (a traced function keeps what it saw)."""
        if not self._is_variable(variable):
            raise ValueError(f"register a variable as local, got {type(variable).__name__}")
        self._warn_if_traced()
        self._local[id(variable)] = variable

    def register_local_layers(self, layers):
        """Marks every trainable variable of ``layers`` as local, including variables the
        layers create after this call (when the first step builds them)."""
        self._warn_if_traced()
        self._local_layers.extend(layers)

    def _local_ids(self):
        ids = set(self._local)
        for layer in self._local_layers:
            ids.update(id(v) for v in layer.trainable_weights)
        return ids

    def active(self):
        """False when there is nothing to average with (one rank, or not a member)."""
        from .process_sets import global_process_set
        ps = self.process_set
        if ps is not global_process_set and not ps.included():
            return False
        return self._set_size(ps) > 1

    def _dense_groups(self, positions, variables):
        """Lists of positions (into the gradient list) reduced together."""
        if self.groups is None or variables is None:
            return [positions]
        members = [variables[i] for i in positions]
        index = {id(v): i for i, v in zip(positions, members)}
        return [[index[id(v)] for v in group]
                for group in form_groups(members, self.groups, None)]

    def __call__(self, grads, variables=None, scale_local=True):
        """``grads`` reduced across ranks (None entries stay None); the gradients of local
        variables stay on this rank (divided by the set size unless ``scale_local`` is False
        or ``scale_local_gradients`` was)."""
        grads = list(grads)
        if self._tracing():
            self._traced = True
        if not self.active():
            return grads
        out = list(grads)
        variables = list(variables) if variables is not None else None
        local = self._local_ids() if variables is not None else ()
        dense = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if local and id(variables[i]) in local:
                if scale_local and self.scale_local_gradients:
                    out[i] = self._divided(g, self._set_size(self.process_set))
                continue
            if self._is_sparse(g):
                if not self.sparse_as_dense:
                    out[i] = self._sparse_allreduce(g)
                    continue
                grads[i] = self._to_dense(g)
            dense.append(i)
        for group in self._dense_groups(dense, variables):
            if not group:
                continue
            pairs = [self.compression.compress(self._to_dense(grads[i])) for i in group]
            reduced = self._allreduce_group([c for c, _ in pairs])
            for i, r, (_, ctx) in zip(group, reduced, pairs):
                out[i] = self.compression.decompress(r, ctx)
        return out
