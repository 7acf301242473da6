"""PopTorch's error classes (poptorch ``python/poptorch.cpp``): ``Error`` carries ``message``,
``type`` and ``location``; Python-side checks use ``type="poptorch_py_error"``."""


class Error(Exception):
    def __init__(self, message, type="poptorch_py_error", location=""):  # noqa: A002 (PopTorch's name)
        super().__init__(message)
        self.message = message
        self.type = type
        self.location = location


class RecoverableError(Error):
    def __init__(self, message, recovery_action="IPU_RESET", **kwargs):
        super().__init__(message, **kwargs)
        self.recovery_action = recovery_action


class UnrecoverableError(Error):
    pass
