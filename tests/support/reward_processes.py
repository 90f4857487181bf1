"""Process-table helpers for the reward sandbox tests: what is still running, read from /proc.

A killed process whose parent has gone may stay a zombie under an init that does not reap; it
holds no memory and runs nothing, so it counts as gone.
"""

from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state, ppid, pgrp, session, ...); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def in_session(sid: int) -> list[int]:
    """Live processes whose process group or session is `sid` (a session leader's pid)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(int(entry.name))
        if fields is not None and fields[0] != "Z" and sid in (int(fields[2]), int(fields[3])):
            found.append(int(entry.name))
    return found
