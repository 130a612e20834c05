"""Which errors the ``lightning-fedrep`` command prints as a refusal (one paragraph, exit status 2, like
argparse) and which keep their traceback.

A refusal is an error raised on purpose about a setting:

- the command's own (:class:`Refused`: an unknown strategy name, a ``ckpt_path`` that is not a file or
  belongs to another federation);
- a ``ValueError`` or ``TypeError`` raised by a ``raise`` statement of this package or of Lightning: the
  argument checks of the strategy, the data modules, the callbacks (``lightning_fedrep.federation.api.arguments``) and
  what the fit's set-up refuses (more clients per round than the data hold, a head that matches nothing);
- Lightning's ``MisconfigurationException`` (its own class for a refused setting).

While the configured objects are built, jsonargparse wraps a class's error in its own ``ValueError``; the
wrapped error decides. For a setting of a union type (``trainer.strategy``: a name or a ``Strategy``)
jsonargparse keeps the alternatives' errors only as text: such a wrapper is taken for a refusal, and the
class's line of its text is printed.

Anything else keeps its traceback: an error Python itself raised in this package (a failed call, a bad
index: a bug), and the errors of other libraries and of the user's own module (torch's shape errors).
``LIGHTNING_FEDREP_TRACEBACK=1`` shows the traceback of a refusal too.
"""

from __future__ import annotations

import dis
import os
from types import CodeType, TracebackType

from lightning.fabric.utilities.exceptions import MisconfigurationException

TRACEBACK_VARIABLE = "LIGHTNING_FEDREP_TRACEBACK"
"""Set to ``1`` to see a refusal's traceback instead of its paragraph."""
_REFUSING_PACKAGES = ("lightning_fedrep", "lightning")
"""Packages whose deliberate ``ValueError``/``TypeError`` are refusals of a setting."""
_WRAPPING_PACKAGES = ("jsonargparse",)
"""Packages that wrap a class's error while building the configured objects (the cause is the refusal)."""
_RAISE_OPCODES = frozenset(dis.opmap[name] for name in ("RAISE_VARARGS", "RERAISE") if name in dis.opmap)


class Refused(Exception):
    """A setting the command itself refuses; its message is what the user reads."""


def refusal_message(error: BaseException) -> str | None:
    """What the command prints for ``error`` if it is a refusal (see the module): its message as one
    paragraph and, but for the command's own refusals, how to see the traceback; ``None`` otherwise."""
    wrapper = None
    while error is not None:
        if isinstance(error, Refused):
            return _one_paragraph(str(error))
        if isinstance(error, MisconfigurationException):
            return _with_hint(str(error))
        if not isinstance(error, ValueError | TypeError):
            return None
        module = raising_module(error)
        if module is not None and _in(module, _WRAPPING_PACKAGES):
            wrapper = wrapper or error
            error = error.__cause__ or error.__context__
            continue
        return _with_hint(str(error)) if module is not None and _in(module, _REFUSING_PACKAGES) else None
    return _with_hint(wrapped_class_error(wrapper)) if wrapper is not None else None


def raising_module(error: BaseException) -> str | None:
    """The module whose ``raise`` statement raised ``error``; ``None`` when Python or C code raised it (a
    call with wrong arguments, a bad index or conversion: the innermost frame was not at a ``raise``)."""
    innermost = _innermost(error.__traceback__)
    if innermost is None or _opcode_at(innermost.tb_frame.f_code, innermost.tb_lasti) not in _RAISE_OPCODES:
        return None
    return str(innermost.tb_frame.f_globals.get("__name__", ""))


def wrapped_class_error(wrapper: BaseException) -> str:
    """The class's own error in jsonargparse's text for a union-typed setting, which lists every
    alternative's ("Expected a <class 'str'>", ...); the text's first line when it has none."""
    lines = [line.strip()[2:] for line in str(wrapper).splitlines() if line.strip().startswith("- ")]
    causes = [
        line
        for line in lines
        if not line.startswith(("Expected a", "Not a valid subclass", "Problem with given class_path"))
    ]
    return "; ".join(causes) if causes else str(wrapper).splitlines()[0]


def traceback_wanted() -> bool:
    """Whether the user asked for refusals' tracebacks (``LIGHTNING_FEDREP_TRACEBACK=1``)."""
    return os.environ.get(TRACEBACK_VARIABLE) == "1"


def _one_paragraph(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _with_hint(message: str) -> str:
    return f"{_one_paragraph(message)} (set {TRACEBACK_VARIABLE}=1 for the traceback)"


def _innermost(traceback: TracebackType | None) -> TracebackType | None:
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback


def _opcode_at(code: CodeType, offset: int) -> int | None:
    return next((i.opcode for i in dis.get_instructions(code) if i.offset == offset), None)


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return module.split(".", 1)[0] in packages
