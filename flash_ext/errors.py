"""The exceptions flash_ext raises for bad input.

Every one of them is a :class:`FlashExtError`, which is a ``RuntimeError``: code written for
FlashAttention (which catches ``RuntimeError``) and code that catches the C++ side's errors
(c10::Error, also a ``RuntimeError``) catches them. Each input error also derives from the
built-in class that describes it, so ``except ValueError`` / ``except TypeError`` /
``except NotImplementedError`` keep working:

    FlashExtError(RuntimeError)                          any flash_ext error raised in Python
      FlashExtValueError(FlashExtError, ValueError)      bad value or shape
        DeviceError                                      not on CUDA, or not on one device
      FlashExtTypeError(FlashExtError, TypeError)        wrong dtype or argument type
      FlashExtNotImplementedError(FlashExtError, NotImplementedError)
                                                         a feature flash_ext does not have

Errors raised by the compiled ops (csrc/, through TORCH_CHECK) are plain ``RuntimeError``s;
the Python layer checks every input before calling them, so users rarely see those.
"""

from __future__ import annotations

__all__ = [
    "FlashExtError",
    "FlashExtValueError",
    "FlashExtTypeError",
    "FlashExtNotImplementedError",
    "DeviceError",
]


class FlashExtError(RuntimeError):
    """Base class of the errors flash_ext raises for bad input (a ``RuntimeError``)."""


class FlashExtValueError(FlashExtError, ValueError):
    """An argument has a bad value or shape (also a ``ValueError``)."""


class FlashExtTypeError(FlashExtError, TypeError):
    """An argument has the wrong dtype or Python type (also a ``TypeError``)."""


class FlashExtNotImplementedError(FlashExtError, NotImplementedError):
    """A feature flash_ext does not implement (also a ``NotImplementedError``)."""


class DeviceError(FlashExtValueError):
    """A tensor is not a CUDA tensor, or the tensors of one call are on different devices
    (a ``ValueError`` and a ``RuntimeError``)."""


for _cls in (FlashExtError, FlashExtValueError, FlashExtTypeError, FlashExtNotImplementedError,
             DeviceError):
    _cls.__module__ = "flash_ext"  # shown in tracebacks as flash_ext.<Name>, where users import it
del _cls
