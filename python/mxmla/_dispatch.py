"""Private: how the Python functions call mxmla's torch custom ops (``_torch_ops``).

An eager call on plain torch tensors runs the op's own function directly: torch's custom-op
dispatch costs tens of microseconds of host time a call, which a small model's training step
spends hundreds of times (it made such steps host-bound). Everything else goes through
``torch.ops.mxmla.<op>``, as before: tracing by torch.compile, fake and meta tensors, dispatch and
torch-function modes, torch.jit tracing, tensor subclasses, functorch transforms, and an input that
needs a gradient (the op's autograd registration then computes it, or raises). Either way the same
function runs on the same arguments, so the results are the same."""
from typing import Any, Callable, Dict

from ._backend import torch  # None without torch: then nothing here is called (no torch tensors)

_EAGER: Dict[str, Callable[..., Any]] = {}
_wrapped = None if torch is None else getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)


def register(name: str, fn: Callable[..., Any]) -> None:
    """The function behind torch.ops.mxmla.<name>."""
    _EAGER[name] = fn


def _plain(a: Any, grad: bool) -> bool:
    t = type(a)
    if t is torch.Tensor:
        return not a.is_meta and not (grad and a.requires_grad) and not _wrapped(a)
    if t is list or t is tuple:
        return all(_plain(b, grad) for b in a)
    return not isinstance(a, torch.Tensor)  # a subclass (fake, functional, ...) goes through the op


def call(name: str, *args: Any) -> Any:
    """torch.ops.mxmla.<name>(*args), or its function directly where that gives the same (above)."""
    fn = _EAGER.get(name)
    # (is_compiling first: torch.compile folds it to True and never meets the C checks after it;
    # torch.jit.trace records only ops, so it gets the op)
    if fn is not None and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0 and \
            not torch._C._is_torch_function_mode_enabled() and not torch._C._is_tracing():
        grad = torch.is_grad_enabled()
        for a in args:
            if not _plain(a, grad):
                break
        else:
            return fn(*args)
    return getattr(torch.ops.mxmla, name)(*args)
