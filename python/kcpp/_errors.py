"""The exceptions of kcpp, shared by the extension (kcpp._core) and the ctypes bridge (kcpp._ctypes)."""

_STATUS_NAMES = {0: "ok", 1: "invalid argument", 2: "unsupported", 3: "out of memory", 4: "runtime error"}


class KcppError(RuntimeError):
    """A failure of kernels.cpp: a package entry point's status other than KCPP_OK (`status` and
    `message` say which), or the hub's refusal (a bad reference, a hash that does not match, an
    untrusted package), whose message says what to do."""

    def __init__(self, where, status=None, message=None):
        if status is None:  # the hub's errors: one message
            self.status, self.message = None, where
            super().__init__(where)
            return
        self.status, self.message = status, message
        # Packages' messages usually start with the entry point's own name: said once.
        text = message[len(where) + 2:] if message.startswith(where + ": ") else message
        super().__init__(f"{where}: {_STATUS_NAMES.get(status, f'status {status}')}: {text}")


class InvalidArgument(KcppError, ValueError):
    """The call broke the layer's contract (shape, dtype, a missing argument)."""


class Unsupported(KcppError):
    """A valid call this kernel does not take: the host should fall back to another implementation."""


class HubDisabled(KcppError):
    """USE_HUB_KERNELS=0|OFF|NO|false: the hub loads no kernel (hosts keep the reference layers)."""
