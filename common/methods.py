"""The method registry: one :class:`Method` per algorithm, the single place that names it.

Everything else is derived from here: the values ``algorithm`` accepts (the run-config
model validates against :func:`names`), the strategy the ServerApp builds, the client
hook the ClientApp dispatches ``train.<name>`` / ``evaluate.<name>`` to, the run-config
section that configures it, whether Flower's LocalDpMod may clip its upload, and the
message keys of its contract (:mod:`common.messages`).

This module is light on purpose (pydantic and the standard library): the strategy and
the hook are named by import path (``"module:attribute"``, as Flower names a
ServerApp or ClientApp in ``pyproject.toml``) and imported when first asked for, so
the run-config model can check a name without importing torch or the server. A
method defined elsewhere (a plugin, a test) may pass the classes themselves and
register with :func:`register`; docs/adding-a-method.md walks through it.

It sits on the ground floor (``common``) and names no upper floor, not even for
typing: the places that use a method's classes name their types
(``strategies.make_strategy``: ``HeteroStrategy``; ``client_app.app``: ``ClientHook``).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from common import messages as keys
from common import sections

NAME = re.compile(r"[a-z][a-z0-9_]*")
"""A method's name: one lower-case word of letters, digits and ``_``, starting with a
letter. Flower routes ``train.<action>`` only where ``<action>`` is a Python
identifier, and the name is also a file name, a results folder and a config value."""


def _resolve(target: Any) -> Any:
    """An object, or the object an import path ``"module:attribute"`` names."""
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Method:
    """One algorithm, declared once.

    Parameters
    ----------
    name
        The one word: the ``algorithm`` value, the message types ``train.<name>`` /
        ``evaluate.<name>``, the strategy's ``name`` and its results folder.
    strategy
        Its strategy class (a ``strategies.base.HeteroStrategy`` subclass), or its
        import path.
    hook
        Its client hook class (a ``client_app.base.ClientHook`` subclass), or its
        import path.
    section
        Its run-config section (``<name>.*`` keys), or None. A built-in method's
        section is also a typed field of :class:`~common.config.RunConfig`; a method
        registered from outside gets its section added when the config is parsed.
    uploads_parameters
        Its reply carries the arrays it was sent, updated, so ``privacy.dp-clip``
        applies Flower's LocalDpMod to it.
    keys
        The message keys (or key prefixes) of its contract, from
        :mod:`common.messages` (documentation and a test: every key a strategy
        expects in a reply starts with one of them).
    """

    name: str
    strategy: Any
    hook: Any
    section: type[BaseModel] | None = None
    uploads_parameters: bool = False
    keys: tuple[str, ...] = field(default=())

    def strategy_class(self) -> Any:
        """The strategy class (imported on first use); ``strategies.make_strategy``
        refuses one that is not a ``HeteroStrategy``."""
        return _resolve(self.strategy)

    def client_hook(self) -> Any:
        """The client hook (a ``ClientHook``), one shared instance per method (hooks
        keep no state)."""
        return _hook_instance(self)


@functools.cache
def _hook_instance(method: Method) -> Any:
    return _resolve(method.hook)()


BUILTIN: tuple[Method, ...] = (
    Method("local", "strategies.local:Local", "client_app.hooks:LocalHook"),
    Method(
        "fedavg",
        "strategies.fedavg:FedAvg",
        "client_app.hooks:FedAvgHook",
        uploads_parameters=True,
    ),
    Method(
        "lgfedavg",
        "strategies.lgfedavg:LGFedAvg",
        "client_app.hooks:LGFedAvgHook",
        uploads_parameters=True,
        keys=(keys.HEAD,),
    ),
    Method(
        "fedproto",
        "strategies.fedproto:FedProto",
        "client_app.prototypes:FedProtoHook",
        section=sections.FedProtoConfig,
        keys=(keys.PROTO,),
    ),
    Method(
        "fedgh",
        "strategies.fedgh:FedGH",
        "client_app.prototypes:FedGHHook",
        section=sections.FedGHConfig,
        keys=(keys.HEAD, keys.PROTO),
    ),
    Method(
        "fedre",
        "strategies.fedre:FedRE",
        "client_app.prototypes:FedREHook",
        section=sections.FedREConfig,
        keys=(keys.HEAD, keys.REP, keys.SOFT_LABEL),
    ),
    Method(
        "fedara",
        "strategies.fedara:FedARA",
        "client_app.fedara:FedARAHook",
        section=sections.FedARAConfig,
        uploads_parameters=True,
        keys=(keys.EXTRACTOR,),
    ),
    Method(
        "fedlora",
        "strategies.fedlora:FedLoRA",
        "client_app.fedlora:FedLoRAHook",
        section=sections.FedLoRAConfig,
        uploads_parameters=True,
        keys=("adapters.",),  # models.adapter.ADAPTERS + "."
    ),
    Method(
        "fedtgp",
        "strategies.fedtgp:FedTGP",
        "client_app.prototypes:FedTGPHook",
        section=sections.FedTGPConfig,
        keys=(keys.PROTO,),
    ),
    Method(
        "fedkd",
        "strategies.fedkd:FedKD",
        "client_app.mutual:FedKDHook",
        section=sections.FedKDConfig,
        keys=(keys.MENTEE,),  # a key whole, or its update as <key>.us / <key>.vt
    ),
    Method(
        "fml",
        "strategies.fml:FML",
        "client_app.mutual:FMLHook",
        section=sections.FMLConfig,
        uploads_parameters=True,
        keys=(keys.MEME,),
    ),
    Method(
        "fd",
        "strategies.fd:FD",
        "client_app.distill:FDHook",
        section=sections.FDConfig,
        keys=(keys.LOGIT,),
    ),
    Method(
        "fedmrl",
        "strategies.fedmrl:FedMRL",
        "client_app.fedmrl:FedMRLHook",
        section=sections.FedMRLConfig,
        uploads_parameters=True,
        keys=(keys.SHARED,),
    ),
    Method(
        "fedgen",
        "strategies.fedgen:FedGen",
        "client_app.fedgen:FedGenHook",
        section=sections.FedGenConfig,
        keys=(keys.HEAD, keys.GENERATOR, keys.LABEL_COUNTS),
    ),
    Method(
        "fedl2g",
        "strategies.fedl2g:FedL2G",
        "client_app.fedl2g:FedL2GHook",
        section=sections.FedL2GConfig,
        keys=(keys.GUIDE, keys.GUIDE_GRAD),
    ),
    Method(
        "fedl2gl",
        "strategies.fedl2gl:FedL2GL",
        "client_app.fedl2g:FedL2GLHook",
        section=sections.FedL2GLConfig,
        keys=(keys.GUIDE, keys.GUIDE_GRAD),
    ),
)


def check_name(name: str) -> str:
    """``name`` if it is a method name (:data:`NAME`), else a ValueError saying why."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"method name {name!r} must be one lower-case word of letters, digits and '_' "
            "(starting with a letter): Flower routes train.<name> only for such a word"
        )
    return name


def registry(builtin: Iterable[Method]) -> dict[str, Method]:
    """The registry of ``builtin`` by name: every name checked (:func:`check_name`),
    a name given twice refused."""
    out: dict[str, Method] = {}
    for method in builtin:
        if check_name(method.name) in out:
            raise ValueError(f"two built-in methods are named {method.name!r}")
        out[method.name] = method
    return out


METHODS: dict[str, Method] = registry(BUILTIN)
"""Every registered method by name (the built-in ones, then any :func:`register`\\ ed)."""


def register(method: Method) -> Method:
    """Add ``method`` (a name already taken by another method is refused)."""
    check_name(method.name)
    known = METHODS.get(method.name)
    if known is not None and known != method:
        raise ValueError(f"a method named {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method registered with :func:`register` (built-in ones stay)."""
    if any(m.name == name for m in BUILTIN):
        raise ValueError(f"{name!r} is built in")
    METHODS.pop(name, None)


def names() -> list[str]:
    """Every value ``algorithm`` accepts, in registration order."""
    return list(METHODS)


def get(name: str) -> Method:
    """The method called ``name``; an error lists the registered ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; known: {', '.join(METHODS)}") from None
