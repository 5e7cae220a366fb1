"""``--model mlp``: what a network job may combine with, and each party's network spec.

A network job runs on the same runtime as the linear one (``parties/party_model.py``), but some
options are the linear model's own, and are refused here in one line each rather than silently
meaning something else:

* ``--algorithm sgd`` only: SVRG's snapshots and SAGA's tables are per-row quantities of a linear
  model; each network steps by Adam from every (ϑ, i) it gets (``--gamma``: Adam's step, 1e-3 by
  default; ``--lam``: weight decay on every parameter, L2 as λ is for the linear model);
* ``-m 1``: the top network lives at the one label holder (several dominators would each step a top
  of their own);
* classification (``--problem logistic``): binary labels (±1) give one logit and the logistic loss,
  class labels 0..C−1 (a multiclass dataset, e.g. Fashion-MNIST) C logits and softmax cross-entropy;
* no ``--label-privacy he``, no f*: encrypted ϑ and the NonF optimum are the linear model's
  (randomized-response label DP, ``dp``, works unchanged: the labels are noised where they are loaded).
  ``--gamma-decay`` decays every party's Adam step by epoch as it decays the linear model's γ: it lets the
  noise of ``--label-privacy dp-theta`` settle (``docs/vertical-networks.md``).

Checked on the options alone, before any rank starts (torch is not imported here).
"""

from __future__ import annotations

from vertical.nn.base import parse_spec

#: Widest cut layer: each message holds B·k values.
MAX_WIDTH = 4096
#: Largest B·k of one message (8 MiB of float64 values): what the receive buffers are sized for.
MAX_VALUES = 1 << 20
#: Adam's step when ``--gamma`` is not given (the linear model derives its γ from the data instead).
DEFAULT_STEP = 1e-3


def bottom_specs(spec: str, parties: int) -> list[str]:
    """One bottom spec per party from ``--bottom`` (one for all, or one per party, comma-separated)."""
    specs = [part.strip() for part in spec.split(",")]
    if len(specs) == 1:
        return specs * parties
    if len(specs) != parties:
        raise ValueError(f"--bottom gives {len(specs)} specs for {parties} parties: give one for all, or "
                         f"one per party in rank order")
    return specs


def cut_width(spec: str, parties: int) -> int:
    """k, the width every party's network ends at (``--bottom``'s last widths, which must agree)."""
    widths = set()
    for one in bottom_specs(spec, parties):
        first = one.split("-", 1)[0].strip()
        # the first width is the party's columns, known only where its data is: '*' or a number here
        layers = parse_spec(one, first=int(first) if first.isdigit() else 1, what="--bottom")
        if len(layers) < 2:
            raise ValueError(f"--bottom spec {one!r}: a party's network needs a layer (columns-k at least)")
        widths.add(layers[-1])
    if len(widths) != 1:
        raise ValueError(f"--bottom: every party's network must end at the same width k (the secure sum "
                         f"adds them), got {sorted(widths)}")
    return widths.pop()


def network_step(gamma: float | None) -> float:
    return DEFAULT_STEP if gamma is None else gamma


def network_refusal(c) -> str | None:
    """Why ``--model mlp`` cannot run with the options ``c`` (module doc), in one line; None if it can.
    (``parties.config.validate`` raises it as a ``ConfigError``.)"""
    refusals = [
        (c.algorithm != "sgd", f"--model mlp runs --algorithm sgd (each network steps by Adam from every "
                               f"(ϑ, i)); {c.algorithm}'s snapshots or tables are the linear model's"),
        (c.active != 1, "--model mlp needs -m 1: the top network lives at the one label holder"),
        (c.problem != "logistic", f"--model mlp trains a classifier with the logistic loss (softmax "
                                  f"cross-entropy for more classes): --problem {c.problem} is not one"),
        (c.label_privacy == "he", "--model mlp cannot run --label-privacy he (encrypted ϑ is the linear "
                                  "model's); use --label-privacy dp"),
        (c.target_suboptimality is not None or c.f_star is not None,
         "--model mlp has no f* (the NonF optimum is the linear model's): drop --target-suboptimality / "
         "--f-star"),
    ]
    for refused, why in refusals:
        if refused:
            return why
    try:
        k = cut_width(c.bottom, c.parties)
        parse_spec(c.top, first=k, last=1, what="--top")
    except ValueError as err:
        return str(err)
    if k > MAX_WIDTH or k * c.batch_size > MAX_VALUES:
        return (f"--bottom's cut layer k = {k} with -B {c.batch_size}: a message would hold "
                f"{k * c.batch_size:,} values (at most k = {MAX_WIDTH} and B·k = {MAX_VALUES:,})")
    return None
