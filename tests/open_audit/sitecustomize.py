"""Test helper, not part of vfl: with ``VFL_OPEN_LOG`` set, every Python process started with this
folder on ``PYTHONPATH`` appends each path it opens, lists, makes, removes or renames to that file,
one ``<pid> <event> <path>`` a line (PEP 578 audit hooks).

``tests/test_federation.py`` puts it on the path of each ``vfl party`` process to check that no party
ever touches another party's folder. It sees what Python code does (``open``, ``os.*``, ``pathlib``,
numpy's file I/O); a C library opening a file on its own would not show.
"""

import contextlib
import os
import sys

_LOG = os.environ.get("VFL_OPEN_LOG")
_EVENTS = {"open": 0, "os.mkdir": 0, "os.remove": 0, "os.rename": 0, "os.listdir": 0, "os.scandir": 0,
           "os.rmdir": 0, "os.chmod": 0, "shutil.rmtree": 0, "os.symlink": 1}

if _LOG:
    _fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _pid = os.getpid()

    def _hook(event, args):
        if event not in _EVENTS or not args:
            return
        path = args[_EVENTS[event]]
        if isinstance(path, int) or path is None:
            return
        try:
            text = os.fsdecode(path)
        except TypeError:
            return
        paths = [text]
        if event == "os.rename" and len(args) > 1 and isinstance(args[1], str | bytes):  # the target too
            paths.append(os.fsdecode(args[1]))
        for one in paths:
            with contextlib.suppress(OSError):
                os.write(_fd, f"{_pid} {event} {os.path.abspath(one)}\n".encode(errors="replace"))

    sys.addaudithook(_hook)
