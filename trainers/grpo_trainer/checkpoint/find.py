"""What `checkpoint.resumeFrom` names, resolved to the saves to try, or a ConfigError saying why not.

Users point `resumeFrom` at what they have at hand: one save (`.../step-N`), a job's save folder
(`.../<name>-<uid>`, the `checkpointDir` of the contract), or the old job's `checkpoint.path`, under
which saves live two levels down (`<path>/<namespace>/<name>-<uid>/step-N`). Called on rank 0 by
`grpo_trainer.checkpoint.resume.candidates_for` before any model is loaded, so a wrong path fails the
pod within seconds, with `ResumeFromNotFound` in the job's status, instead of starting over from
step 0 while the user believes the run continued.
"""

from dataclasses import dataclass

from grpo_operator import storage
from grpo_operator.api.status import Reason
from grpo_operator.storage.check import POD_CREDENTIALS, Expect, PathError, check

from grpo_trainer.checkpoint import layout
from grpo_trainer.checkpoint.saver import list_saves
from grpo_trainer.config import ConfigError

FIELD = "spec.checkpoint.resumeFrom"
JOB_LEVELS = 2  # <checkpoint.path>/<namespace>/<name>-<uid>
LOOKED_FOR = (
    "looked for {u}/meta.json (a save), {u}/step-*/meta.json (a job's save folder) and "
    "{u}/*/*/step-*/meta.json (the checkpoint.path of another job)"
)


@dataclass(frozen=True)
class JobSaves:
    """One job's save folder and its complete saves, newest first."""

    folder: str
    steps: list[int]

    def paths(self) -> list[str]:
        return [storage.join(self.folder, layout.step_name(s)) for s in self.steps]


def job_saves(folder: str) -> JobSaves:
    complete, _ = list_saves(folder)
    return JobSaves(folder, layout.newest_first(complete))


def _subfolders(fs: object, path: str) -> list[str]:
    entries = fs.ls(path, detail=True)  # type: ignore[attr-defined]
    return sorted(str(e["name"]) for e in entries if e.get("type") == "directory")


def jobs_below(uri: str, levels: int = JOB_LEVELS) -> list[JobSaves]:
    """Job save folders within `levels` folders below `uri` holding at least one complete save."""
    fs, root = storage.filesystem(uri)
    found: list[JobSaves] = []
    frontier = [root]
    for _ in range(levels):
        nxt = []
        for path in frontier:
            for sub in _subfolders(fs, path):
                if layout.step_of(sub) is not None:
                    continue  # a save folder: its parent was already considered as a job folder
                saves = job_saves(storage.join(uri, sub[len(root) :].strip("/")))
                if saves.steps:
                    found.append(saves)
                else:
                    nxt.append(sub)
        frontier = nxt
    return found


def not_found(uri: str, why: str) -> ConfigError:
    return ConfigError(f"{FIELD} {uri}: {why}", reason=Reason.RESUME_FROM_NOT_FOUND)


def resume_from_candidates(uri: str) -> list[str]:
    """The saves `uri` names, newest first; ConfigError (ResumeFromNotFound) when it names none, or
    several jobs (listed with their newest step, so the user picks one)."""
    try:  # the rule validate --check-paths applies offline: an existing, non-empty folder
        check(FIELD, uri, Expect.SAVES, credentials=POD_CREDENTIALS)
    except PathError as e:
        unresolved = e.reason in (Reason.PATH_NOT_FOUND, Reason.PATH_WRONG_KIND, Reason.PATH_EMPTY)
        raise ConfigError(str(e), reason=Reason.RESUME_FROM_NOT_FOUND if unresolved else e.reason) from None
    fs, path = storage.filesystem(uri)
    if fs.exists(f"{path}/{layout.MARKER}"):
        return [uri]
    if layout.step_of(uri) is not None:
        raise not_found(
            uri, f"is an incomplete save (no {layout.MARKER}: it was interrupted while being written)"
        )
    own = job_saves(uri)
    if own.steps:
        return own.paths()
    jobs = jobs_below(uri)
    if len(jobs) == 1:
        return jobs[0].paths()
    if jobs:
        listed = "; ".join(f"{j.folder} (newest step {j.steps[0]})" for j in jobs)
        raise not_found(uri, f"holds the saves of {len(jobs)} jobs, name one of them: {listed}")
    _, incomplete = list_saves(uri)
    extra = f"; it holds {len(incomplete)} incomplete save(s) only" if incomplete else ""
    raise not_found(uri, f"no complete checkpoint under it ({LOOKED_FOR.format(u=uri.rstrip('/'))}){extra}")
