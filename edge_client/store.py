"""Conversations kept on the device in SQLite: messages, settings, each reply's figures, and the token ids
of the conversation so far (so its next turn extends them and the verifier's kept cache matches).

Every write is its own committed transaction (WAL journal), and a user's message is written before its
reply is generated: a crash or kill of the edge loses at most the reply in flight.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    settings TEXT NOT NULL,          -- JSON: edge_client.openai_api.Settings.as_json()
    context_ids TEXT NOT NULL        -- JSON: prompt and reply token ids of the last turn
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL,
    figures TEXT                     -- JSON: a reply's finish reason and timings; NULL for the user's
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


class NotFound(KeyError):
    """No conversation with that id."""


class Store:
    def __init__(self, path: Path | str):
        """Opens (creating) the database at `path`; ":memory:" keeps nothing."""
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def create(self, title: str, settings: dict) -> dict:
        now = time.time()
        cid = uuid.uuid4().hex[:16]
        self.db.execute(
            "INSERT INTO conversations VALUES (?, ?, ?, ?, ?, '[]')",
            (cid, title, now, now, json.dumps(settings)),
        )
        return self.get(cid)

    def list(self) -> list[dict]:
        """Every conversation, the most recently updated first, without its messages."""
        rows = self.db.execute(
            "SELECT c.id, c.title, c.created, c.updated, COUNT(m.id) AS messages FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id ORDER BY c.updated DESC"
        )
        return [dict(r) for r in rows]

    def get(self, cid: str) -> dict:
        """A conversation with its settings and messages. Raises NotFound."""
        row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (cid,)).fetchone()
        if row is None:
            raise NotFound(cid)
        messages = self.db.execute(
            "SELECT role, content, created, figures FROM messages WHERE conversation_id = ? ORDER BY id",
            (cid,),
        )
        return {
            "id": row["id"],
            "title": row["title"],
            "created": row["created"],
            "updated": row["updated"],
            "settings": json.loads(row["settings"]),
            "messages": [
                {**dict(m), "figures": json.loads(m["figures"]) if m["figures"] else None} for m in messages
            ],
        }

    def context_ids(self, cid: str) -> list[int]:
        row = self.db.execute("SELECT context_ids FROM conversations WHERE id = ?", (cid,)).fetchone()
        if row is None:
            raise NotFound(cid)
        return json.loads(row["context_ids"])

    def add_message(self, cid: str, role: str, content: str, figures: dict | None = None) -> None:
        """Appends a message. Raises NotFound."""
        self._touch(cid)
        self.db.execute(
            "INSERT INTO messages (conversation_id, role, content, created, figures) VALUES (?, ?, ?, ?, ?)",
            (cid, role, content, time.time(), json.dumps(figures) if figures is not None else None),
        )

    def update(
        self,
        cid: str,
        title: str | None = None,
        settings: dict | None = None,
        context_ids: list[int] | None = None,
    ) -> None:
        """Changes what is given. Raises NotFound."""
        self._touch(cid)
        for column, value in (("title", title), ("settings", settings), ("context_ids", context_ids)):
            if value is not None:
                value = value if column == "title" else json.dumps(value)
                self.db.execute(f"UPDATE conversations SET {column} = ? WHERE id = ?", (value, cid))

    def cut_last_reply(self, cid: str, shown: str) -> bool:
        """A stopped reply kept as the user saw it: the last message, a reply that begins with `shown`, is
        cut to it and marked stopped, and the last turn's token ids are dropped (the next turn tokenizes the
        conversation's text). Returns whether it was cut. Raises NotFound."""
        self._touch(cid)
        row = self.db.execute(
            "SELECT id, role, content, figures FROM messages WHERE conversation_id = ?"
            " ORDER BY id DESC LIMIT 1",
            (cid,),
        ).fetchone()
        if row is None or row["role"] != "assistant" or not row["content"].startswith(shown):
            return False
        figures = json.loads(row["figures"]) if row["figures"] else {}
        figures["finish_reason"] = "cancelled"
        self.db.execute(
            "UPDATE messages SET content = ?, figures = ? WHERE id = ?",
            (shown, json.dumps(figures), row["id"]),
        )
        self.db.execute("UPDATE conversations SET context_ids = '[]' WHERE id = ?", (cid,))
        return True

    def delete(self, cid: str) -> None:
        """Deletes a conversation and its messages. Raises NotFound."""
        if self.db.execute("DELETE FROM conversations WHERE id = ?", (cid,)).rowcount == 0:
            raise NotFound(cid)

    def _touch(self, cid: str) -> None:
        cursor = self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), cid))
        if cursor.rowcount == 0:
            raise NotFound(cid)
