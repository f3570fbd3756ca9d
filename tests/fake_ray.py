"""A stand-in for the few Ray calls a :class:`~prism_challenge.service.dispatch.Dispatcher` makes
in its rounds, so its real loop (``step()``) runs against a real database in milliseconds.

:class:`FakeRay` replaces ``ray.remote(Evaluation)`` (the dispatcher's ``_remote``) and
``ray.wait``, ``ray.get`` and ``ray.kill`` (patched on the ``ray`` module with pytest's
``monkeypatch``). Each actor it makes answers ``result()`` at once with ``answer(job)`` in the
payload shape of :meth:`Evaluation.result <prism_challenge.service.worker.Evaluation.result>`
(``{"token", "result"}``), and ``where()`` with a fixed node. ``reconcile`` is not faked: set the
dispatcher's ``_last_reconcile`` so its rounds skip it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

NODE = {"ip": "10.0.0.9", "node_id": "ab" * 28, "pid": 4242}


@dataclass(eq=False)  # hashed by identity, as Ray's refs are keys of the dispatcher's dicts
class Ref:
    """An object ref whose value is known at once."""

    value: Any


@dataclass
class _Method:
    call: Callable[..., Any]

    def remote(self, *args: Any) -> Ref:
        return Ref(self.call(*args))


@dataclass
class Actor:
    """One attempt's actor: its job, its options (name, resources) and whether it was killed."""

    job: Any
    options: dict
    answer: Callable[[Any], Any]
    killed: bool = False
    result: _Method = field(init=False)
    where: _Method = field(init=False)

    def __post_init__(self) -> None:
        self.result = _Method(lambda _wait_s=None: {"token": self.job.token,
                                                    "result": self.answer(self.job).model_dump(mode="json")})
        self.where = _Method(lambda: dict(NODE))


class FakeRay:
    """Actors that answer at once (``answer(job) -> EvalResult``); ``actors``: each one made, in order."""

    def __init__(self, answer: Callable[[Any], Any]):
        self.answer = answer
        self.actors: list[Actor] = []
        self._options: dict = {}

    def install(self, dispatcher: Any, monkeypatch: Any) -> None:
        """Make ``dispatcher`` create its actors here, and patch ``ray.wait``/``get``/``kill``."""
        import ray

        dispatcher._remote = self
        monkeypatch.setattr(ray, "wait", self.wait)
        monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref.value)
        monkeypatch.setattr(ray, "kill", self.kill)

    # ray.remote(Evaluation).options(**kw).remote(job)
    def options(self, **kw: Any) -> FakeRay:
        self._options = kw
        return self

    def remote(self, job: Any) -> Actor:
        actor = Actor(job, self._options, self.answer)
        self.actors.append(actor)
        return actor

    @staticmethod
    def wait(refs: list[Ref], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Ref], list[Ref]]:
        return list(refs), []

    @staticmethod
    def kill(actor: Actor, no_restart: bool = True) -> None:
        actor.killed = True
