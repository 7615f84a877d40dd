"""Agent task sessions (docs/architecture.md, "Sessions"): the ledger of which live task
holds which block (:mod:`.ledger`), made durable by a journal (:mod:`.journal`)."""
from kvstore.sessions.journal import SessionJournal
from kvstore.sessions.ledger import SessionError, SessionLedger, TaskNotFound

__all__ = ["SessionError", "SessionJournal", "SessionLedger", "TaskNotFound"]
