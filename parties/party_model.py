"""What the data plane computes with: a party's contribution to rows, ϑ at a label holder, its own step.

The runtime drives one of two *parts* through the same calls, so there is one runtime for both models
(``docs/vertical-networks.md``):

* :class:`LinearPart` - VFB²'s block: ``w_l·x_i`` (k = 1) and the update rule's numba kernels, which
  write ``w`` lock-free from several threads (each its own writer slot); messages queued meanwhile are
  applied in one kernel call (the same result);
* :class:`NetworkPart` - a party's network of :mod:`vertical.nn` (k values a row): a torch model is not
  lock-free, so one lock serialises its forward passes and steps. In the lock-step modes each (ϑ, i)
  message is one step (split learning exactly). Asynchronously, a party that has fallen behind takes
  the messages queued meanwhile together: one gradient on the union of their rows, then one optimizer
  step per message (:meth:`NetworkPart.step`), so a slow party catches up with one backward per queue
  and still steps as often as the top (``docs/vertical-networks.md``).

Values cross as flat float64 arrays: a contribution of B rows is B·k values (each row's k together),
and so is ϑ, the layout of the k-wide (ϑ, i) message (``vertical/nn/messages.py``).
"""

from __future__ import annotations

import threading

import numpy as np

from vertical.nn.protection import RowNoise


class Diverged(ArithmeticError):
    """A label holder's ϑ is not finite: the run diverged (the job ends with that outcome)."""


class LinearPart:
    """``w·x`` of a party's linear block and its VFB² update rule (k = 1)."""

    k = 1
    #: queued (ϑ, i) messages may be applied in one kernel call: the same iterates (a linear block's
    #: gradient does not depend on ``w``, so the step of the union of their rows is the sum of theirs)
    merges_messages = True
    #: a B = 1 update takes microseconds: the communication thread waits in MPI's blocking receive
    polls = False

    def __init__(self, party) -> None:
        self.party = party
        #: called after each new γ (the compiled pump registers itself: --engine compiled)
        self.on_new_step = None

    def contribute(self, rows: np.ndarray) -> np.ndarray:
        return self.party.rule.products(self.party.w, rows)

    def step(self, rows: np.ndarray, thetas: np.ndarray, writer: int, messages: int = 1) -> None:
        self.party.rule.apply(self.party.w, rows, thetas, writer=writer)

    def set_step(self, gamma: float) -> None:
        """The update rule's γ from now on (``--gamma-decay``, at whole epochs); and the compiled pump's,
        which keeps γ in arrays of its own (``parties/compiled_pump.py``)."""
        self.party.rule.set_gamma(gamma)
        if self.on_new_step is not None:
            self.on_new_step()

    def theta(self, scores: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """ϑ of the loss at a label holder for its sampled ``rows``."""
        party = self.party
        return np.asarray(party.problem.theta(scores, party.y[rows]), dtype=np.float64)

    def warm_up(self) -> None:
        """Compile the numba kernels now, so that JIT time never counts as training time."""
        party, none = self.party, np.zeros(0, dtype=np.int64)
        party.rule.products(party.w, none)
        party.rule.apply(party.w.copy(), none, np.zeros(0))
        # every drain calls it: compiled now, or the first drain would be a silent step of seconds
        party.rule.synchronize(party.w.copy())

    def synchronize(self) -> None:
        """Bring every coordinate up to date (lazy kernels); nothing writes meanwhile."""
        self.party.rule.synchronize(self.party.w)


class NetworkPart:
    """A party's network (``party.network``, a :class:`~vertical.nn.base.PartyModel`) and, at the label
    holder, the top network with the loss (``party.top``) on the labels as class indices."""

    #: in lock-step, one step per message; asynchronously, the messages that queued up while the party
    #: worked are taken together (:meth:`step`)
    merges_messages = False
    #: the communication thread polls (sleeping up to 1 ms) rather than spinning in MPI's blocking
    #: receive: a network's messages come milliseconds apart, and a spinning receiver takes the core
    #: from the party's own forward and backward passes
    polls = True

    def __init__(self, party) -> None:
        self.model = party.network
        self.top = getattr(party, "top", None)
        self.labels = getattr(party, "classes", None)
        self.k = int(self.model.k)
        self.lock = threading.Lock()
        #: ``--label-privacy dp-theta``: the release of each row's ϑ (clipped, noised; the top by DP-SGD)
        self.protection = None

    def contribute(self, rows: np.ndarray) -> np.ndarray:
        with self.lock:
            return np.ascontiguousarray(self.model.forward(rows), dtype=np.float64).ravel()

    def step(self, rows: np.ndarray, thetas: np.ndarray, writer: int, messages: int = 1) -> None:
        """The step of ``messages`` (ϑ, i) messages whose rows and ϑ are concatenated here: one gradient
        of the batch-mean loss on all their rows, then one optimizer step per message. A network's
        gradient depends on its parameters, so the union is not the sum of the messages' steps as for
        a linear block; one step in all (the mean of the union) cost a party that falls behind up to
        1.4 points of Fashion-MNIST accuracy (docs/vertical-networks.md), since it stepped fewer times
        than the top. One backward per queue is still what lets a slow party catch up."""
        with self.lock:
            self.model.backward(rows, thetas.reshape(-1, self.k), steps=messages)

    def set_step(self, gamma: float) -> None:
        """Every optimiser's step (the bottom's, and the top's at the label holder) from now on:
        ``--gamma-decay`` at whole epochs, where no message is being applied (the lock besides)."""
        with self.lock:
            for model in (self.model, self.top):
                optimizer = getattr(model, "optimizer", None)
                for group in [] if optimizer is None else optimizer.param_groups:
                    group["lr"] = gamma

    def theta(self, scores: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The top's step on ``z_B`` (the secure sum of every party's contribution) and the rows' ϑ."""
        assert self.top is not None and self.labels is not None, "only a label holder computes ϑ"
        if isinstance(self.protection, RowNoise):  # an identity top: ϑ, then each row's own noise
            theta, _ = self.top.step(scores.reshape(-1, self.k), self.labels[rows])
            theta = self.protection.release(theta, rows)
        else:
            theta, _ = self.top.step(scores.reshape(-1, self.k), self.labels[rows], self.protection)
        theta = np.ascontiguousarray(theta, dtype=np.float64).ravel()
        if not np.all(np.isfinite(theta)):  # sent, every receiver would refuse it and name this party
            raise Diverged("the top's ϑ is not finite: the networks diverged (lower --gamma, Adam's step)")
        return theta

    def warm_up(self) -> None:
        self.contribute(np.zeros(1, dtype=np.int64))

    def embed(self, X) -> np.ndarray:
        """``h_l(x)`` of every row of ``X`` (its own columns), ``(n, k)``: evaluation and prediction."""
        with self.lock:
            return self.model.embed(X)

    def state(self) -> dict[str, np.ndarray]:
        """The network's (and the top's) parameters and optimiser state, as named arrays: a checkpoint."""
        with self.lock:
            state = {f"bottom/{name}": value for name, value in self.model.state_dict().items()}
        if self.top is not None:
            state.update({f"top/{name}": value for name, value in self.top.state_dict().items()})
        return state

    def state_shapes(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """The arrays a checkpoint of this part may hold, with their shapes, and those it must hold (the
        parameters: an optimiser's state exists only once it has stepped)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for prefix, model in (("bottom/", self.model), ("top/", self.top)):
            if model is None:
                continue
            for index, (name, p) in enumerate(model.net.named_parameters()):
                shapes[f"{prefix}param/{name}"] = tuple(p.shape)
                for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                    shapes[f"{prefix}optim/{index}/{key}"] = tuple(p.shape)
                shapes[f"{prefix}optim/{index}/step"] = ()
        return shapes, {name for name in shapes if "/param/" in name}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore :meth:`state` (names and shapes checked, one line on a mismatch)."""
        with self.lock:
            self.model.load_state_dict(_prefixed(state, "bottom/"))
        if self.top is not None:
            self.top.load_state_dict(_prefixed(state, "top/"))

    def synchronize(self) -> None:
        """A network's steps are applied whole: nothing to bring up to date."""


def _prefixed(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}


def part_of(party) -> LinearPart | NetworkPart:
    """The part the runtime drives for ``party``: its network when it has one, else its linear block."""
    return NetworkPart(party) if getattr(party, "network", None) is not None else LinearPart(party)


def label_flip(config) -> float:
    """``--label-noise-correction forward``: the flip rate of ``--label-privacy dp``'s labels, which the
    top's loss undoes in expectation; 0 otherwise (the labels taken as they are)."""
    if config.label_noise_correction != "forward":
        return 0.0
    from vertical.label_privacy import flip_probability

    return flip_probability(config.epsilon)


def attach_network(config, party, X_train) -> None:
    """``--model mlp``: give ``party`` its network (its ``--bottom`` spec, seeded ``seed + rank``) and, at
    the label holder, the top (seeded ``seed + q``, as :func:`vertical.nn.networks.build_split_network`
    seeds them) and the labels as class indices. torch runs on the threads the launcher gave this rank
    (``parties/threads.py``), one by default beside the other ranks."""
    import torch

    from parties.model_options import bottom_specs, network_step
    from parties.threads import configured
    from vertical.nn.networks import MLPBottom, MLPTop, OptimizerSpec

    torch.set_num_threads(configured() or 1)
    optimizer = OptimizerSpec("adam", lr=network_step(config.gamma), weight_decay=config.lam)
    spec = bottom_specs(config.bottom, config.parties)[party.rank]
    try:
        party.network = MLPBottom(X_train, spec, optimizer=optimizer, seed=config.seed + party.rank)
        if party.y is not None:
            party.classes = as_classes(party.y)
            party.top = MLPTop(config.top, class_count(party.y, party.y_test), k=party.network.k,
                               optimizer=optimizer, seed=config.seed + config.parties,
                               label_flip=label_flip(config))
    except ValueError as err:
        raise ValueError(f"party {party.rank}: {err}") from None


def load_trained_network(folder, rank: int, n_features: int, epochs: float, bottom: str, top: str,
                         labels=None):
    """Party ``rank``'s trained network for inference (a
    :class:`~parties.party_model.NetworkPart`): rebuilt from its ``bottom`` spec (and, given the
    leader's ``labels``, the top's, with as many classes as training saw:
    :func:`attach_network`) and loaded from its checkpoint of ``epochs`` with every
    name and shape checked, as ``vfl predict`` loads it. No optimiser is built (no step is taken)."""
    from types import SimpleNamespace

    from parties.checkpoint import load_checkpoint
    from vertical.nn.networks import MLPBottom, MLPTop

    network = MLPBottom(np.zeros((1, n_features)), bottom, optimizer=None)
    head = None
    if labels is not None:
        head = MLPTop(top, class_count(*labels), k=network.k, optimizer=None)
    part = NetworkPart(SimpleNamespace(network=network, top=head, classes=None))
    ckpt = load_checkpoint(folder, rank, n_features, epochs, part.state_shapes())
    assert ckpt.network is not None
    part.load_state({name: value for name, value in ckpt.network.items() if "/param/" in name})
    return part


def run_network(config, party, epochs: float) -> NetworkPart:
    """``--model mlp``: the trained network of ``party`` (a rank's :func:`parties.loading.load_party`
    with ``network=False``) in the run ``config``, the leader's with its top, on the torch threads the
    launcher gave this rank (one by default beside the others): ``vfl predict`` and ``vfl serve``."""
    import torch

    from parties.model_options import bottom_specs
    from parties.threads import configured

    torch.set_num_threads(configured() or 1)
    rank = party.rank
    labels = None if party.y is None else (party.y, party.y_test)
    return load_trained_network(config.party_folder(rank), rank, party.block.n_cols, epochs,
                                bottom_specs(config.bottom, config.parties)[rank], config.top, labels)


def class_count(*labels) -> int:
    """How many classes a top predicts for these label arrays (training's, the test rows'; None or
    empty ones skipped): at least 2, else one more than the largest class number."""
    seen = [as_classes(y) for y in labels if y is not None and np.size(y)]
    return max([2, *(int(y.max()) + 1 for y in seen)])


def as_classes(y: np.ndarray) -> np.ndarray:
    """Labels as a network's top takes them: ±1 (the binary encoding of the party files) as 0/1, class
    labels 0..C−1 (multiclass) as they are; anything else is one ``ValueError`` line."""
    y = np.asarray(y)
    if np.all((y == 1) | (y == -1)):
        return (y > 0).astype(np.int64)
    if np.all(y == np.floor(y)) and y.size and y.min() >= 0:
        return y.astype(np.int64)
    raise ValueError("a network classifies: the labels must be ±1 or class numbers 0, 1, 2, ...")
