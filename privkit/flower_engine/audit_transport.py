"""The audit's transport to a Flower app's ClientApps: probe sessions and mutations in messages.

A white-box audit (:mod:`privkit.mechanisms.probes`) puts canaries into the DP mechanisms a run executes, and
a mutation (:mod:`privkit.mechanisms.mutations`) breaks them on purpose; both are context variables of the
process that trains. On Flower's simulation engine the ClientApps run in Ray actors, other
processes: :class:`AuditedGrid` wraps the ServerApp's grid so that every message carries the
audit's mutation and probe session, and the client mod :func:`audit_mod` runs the ClientApp inside
them and sends back the canaries that observed a release, which the grid puts back in the session.

The mod unpickles what the message carries: it is for simulations the auditor runs, never for a
node that takes messages from a server it does not trust.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterable
from functools import lru_cache

from privkit.mechanisms import mutations, probes

AUDIT = "privkit.audit"  # ConfigRecord: the audit's mutation and probe session (and the probes sent back)

__all__ = ["AUDIT", "AuditedGrid", "audit_mod", "audited_grid"]


# ----------------------------------------------------------------------------- the client mod
def audit_mod(msg, context, call_next):
    """Flower client mod: run the ClientApp inside the audit's mutation and probe session carried by
    ``msg`` (nothing changes for a message without them) and attach the canaries that observed a
    release to the reply. Add it to a ClientApp that runs privkit DP mechanisms to audit them:
    ``ClientApp(mods=[audit_mod])``.

    Parameters
    ----------
    msg : flwr.app.Message
        The message the node received.
    context : flwr.app.Context
        The node's context.
    call_next : callable
        The rest of the ClientApp (the next mod, or the app itself): ``call_next(msg, context)``.

    Returns
    -------
    flwr.app.Message
        The reply, with the probes that observed a release attached.
    """
    if not msg.has_content() or AUDIT not in msg.content:
        return call_next(msg, context)
    from flwr.app import ConfigRecord

    record = msg.content[AUDIT]
    mutation = pickle.loads(record["mutation"])
    session = pickle.loads(record["probes"]) if "probes" in record else None
    before = {k: c.steps for k, c in session.probes.items()} if session is not None else {}
    probing = (
        probes.probing(session.plan, session) if session is not None else contextlib.nullcontext()
    )
    with mutations.mutated(mutation), probing:
        reply = call_next(msg, context)
    if session is not None and reply.has_content():
        seen = {k: c for k, c in session.probes.items() if before.get(k) != c.steps}
        if seen:
            reply.content[AUDIT] = ConfigRecord({"probes": pickle.dumps(seen)})
    return reply


# ----------------------------------------------------------------------------- the server's grid
@lru_cache(maxsize=1)
def _audited_class():
    """:class:`AuditedGrid` as a subclass of Flower's ``Grid`` (Flower imported on first use)."""
    from flwr.serverapp import Grid

    return type("AuditedFlowerGrid", (AuditedGrid, Grid), {})


def audited_grid(grid):
    """``grid`` itself outside an audit; inside one (a :func:`privkit.mechanisms.probes.probing` block or a
    :func:`privkit.mechanisms.mutations.mutated` one), an :class:`AuditedGrid` around it."""
    mutation, session = mutations.active(), probes.current()
    if mutation == mutations.CORRECT and session is None:
        return grid
    return AuditedGrid.around(grid, mutation, session)


class AuditedGrid:
    """A Flower Grid that adds the audit's mutation and probe session to every message it sends
    and takes back the canaries that the replies carry (:func:`audit_mod`). Built by :meth:`around`
    (a subclass of Flower's ``Grid``, made when Flower is imported)."""

    @classmethod
    def around(cls, grid, mutation, session):
        out = _audited_class()()
        out.inner, out.mutation, out.session = grid, mutation, session
        return out

    # Grid's interface, delegated
    def set_run(self, run) -> None:
        self.inner.set_run(run)

    @property
    def run(self):
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable):
        return self.inner.push_messages([self._attach(m) for m in messages])

    def pull_messages(self, message_ids: Iterable[str]):
        return [self._collect(r) for r in self.inner.pull_messages(message_ids)]

    def send_and_receive(self, messages: Iterable, *, timeout: float | None = None):
        replies = self.inner.send_and_receive([self._attach(m) for m in messages], timeout=timeout)
        return [self._collect(r) for r in replies]

    def _attach(self, msg):
        from flwr.app import ConfigRecord

        rec = {"mutation": pickle.dumps(self.mutation)}
        if self.session is not None:
            rec["probes"] = pickle.dumps(self.session)
        msg.content[AUDIT] = ConfigRecord(rec)
        return msg

    def _collect(self, reply):
        if reply.has_content() and AUDIT in reply.content:
            if self.session is not None:
                self.session.probes.update(pickle.loads(reply.content[AUDIT]["probes"]))
            del reply.content[AUDIT]
        return reply
