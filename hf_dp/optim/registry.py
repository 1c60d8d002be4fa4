"""The optimizer registry: the single source of truth for DP optimizer names.

A leaf module: it imports nothing of hf_dp. ``register`` is used as a class decorator by each optimizer
file; the package ``hf_dp.optim`` imports those files, so importing anything from ``hf_dp.optim`` (this
module included) fills the registry. The trainer, the argument parser, the recipes and the docs all read
names from here; :func:`hf_dp.optim.build.make_optimizer` builds an optimizer from a name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    rule_cls: type
    source: str
    summary: str


_REGISTRY: dict[str, OptimizerEntry] = {}


def register(name: str, *, source: str, summary: str):
    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"optimizer {name!r} is already registered")
        cls.registry_name = name
        _REGISTRY[name] = OptimizerEntry(name, cls, source, summary)
        return cls

    return deco


def optimizer_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_entry(name: str) -> OptimizerEntry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown DP optimizer {name!r}; choose one of {', '.join(_REGISTRY)}") from None


def is_dp_optimizer(name) -> bool:
    return str(getattr(name, "value", name)) in _REGISTRY
