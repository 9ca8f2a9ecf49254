"""Session log in SQLite through the SQLAlchemy 2.0 ORM. Knows nothing of torch or Gradio.

A turn is written when it starts (status "running") and completed when it ends, so a process
killed mid-generation leaves a row that the next start marks "incomplete" instead of losing it.
Database path: DYNCHAT_DB (default data/dynchat.db); DYNCHAT_STORE_TEXT=0 keeps message text out.
"""
from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
from sqlalchemy import (
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    create_engine,
    event,
    func,
    inspect,
    select,
    update,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship

from .. import ROOT
from .metrics import AVERAGED, METRIC_NAMES, ROUND_FIELDS, TURN_METRICS


def _now() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class ChatSession(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)       # stable client id from the browser
    created_at: Mapped[datetime] = mapped_column(default=_now)
    turns: Mapped[list[Turn]] = relationship(back_populates="session")


class Turn(Base):
    __tablename__ = "turns"
    id: Mapped[int] = mapped_column(primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    status: Mapped[str] = mapped_column(String(16), default="running")  # running|ok|cancelled|error|incomplete
    error: Mapped[str | None] = mapped_column(Text)
    preset: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256))
    weights: Mapped[str | None] = mapped_column(String(16))      # float32, bfloat16, int8, int4: what the target ran
    assistant: Mapped[str | None] = mapped_column(String(256))
    mode: Mapped[str] = mapped_column(String(16))
    policy: Mapped[str | None] = mapped_column(String(64))
    max_new_tokens: Mapped[int]
    temperature: Mapped[float]
    top_p: Mapped[float]
    prompt_tokens: Mapped[int | None]
    prompt_text: Mapped[str | None] = mapped_column(Text)
    reply_text: Mapped[str | None] = mapped_column(Text)
    session: Mapped[ChatSession] = relationship(back_populates="turns")
    rounds: Mapped[list[Round]] = relationship(back_populates="turn", cascade="all, delete-orphan")


for _metric in TURN_METRICS:        # one nullable column per metric (metrics.py)
    setattr(Turn, _metric.name, mapped_column(Integer if _metric.kind is int else Float, nullable=True))


class Round(Base):
    __tablename__ = "rounds"
    id: Mapped[int] = mapped_column(primary_key=True)
    turn_id: Mapped[int] = mapped_column(ForeignKey("turns.id"), index=True)
    idx: Mapped[int]
    turn: Mapped[Turn] = relationship(back_populates="rounds")


for _field, _kind in ROUND_FIELDS.items():      # one column per round field (metrics.py)
    setattr(Round, _field, mapped_column(Integer if _kind is int else Float, nullable=False))


TURN_COLUMNS = ["id", "created_at", "status", "preset", "mode", "policy", "max_new_tokens", "temperature", "top_p",
                "prompt_tokens", *METRIC_NAMES, "target", "weights", "assistant", "error"]


def default_path() -> Path:
    return Path(os.environ.get("DYNCHAT_DB", ROOT / "data" / "dynchat.db"))


class StoreError(RuntimeError):
    """The session log cannot be opened where it is asked for: one line for the person starting the app."""


class Store:
    def __init__(self, path: str | Path | None = None, store_text: bool | None = None):
        self.path = Path(path) if path else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"the session log {self.path} cannot be created: {e.strerror or e} "
                             "(set DYNCHAT_DB to a writable path)") from None
        try:
            self._open(store_text)
        except SQLAlchemyError as e:
            reason = getattr(e, "orig", None) or e
            raise StoreError(f"the session log {self.path} cannot be opened: {reason} "
                             "(move the file away or set DYNCHAT_DB to another path)") from None

    def _open(self, store_text: bool | None) -> None:
        self.store_text = os.environ.get("DYNCHAT_STORE_TEXT", "1") != "0" if store_text is None else store_text
        self.engine = create_engine(f"sqlite:///{self.path}", connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(self.engine, "connect")
        def _pragmas(conn, _):
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        Base.metadata.create_all(self.engine)
        self._check_columns()
        with Session(self.engine) as s, s.begin():   # turns cut off by a crash or kill
            s.execute(update(Turn).where(Turn.status == "running").values(status="incomplete"))

    def _check_columns(self) -> None:
        """A log written by another version of the schema is refused with one line, left as it is."""
        for table in Base.metadata.sorted_tables:
            have = {c["name"] for c in inspect(self.engine).get_columns(table.name)}
            missing = [c.name for c in table.columns if c.name not in have]
            if missing:
                raise StoreError(f"the session log {self.path} was written by another version of dynchat (its "
                                 f"{table.name} table lacks {', '.join(missing)}); move it away or set DYNCHAT_DB "
                                 "to another path")

    def start_turn(self, session_id: str, prompt: str, **fields) -> int:
        with Session(self.engine) as s, s.begin():
            if s.get(ChatSession, session_id) is None:
                s.add(ChatSession(id=session_id))
            turn = Turn(session_id=session_id, prompt_text=prompt if self.store_text else None, **fields)
            s.add(turn)
            s.flush()
            return turn.id

    def finish_turn(self, turn_id: int, status: str, rounds: list[dict] = (), reply: str | None = None, **fields) -> None:
        with Session(self.engine) as s, s.begin():
            turn = s.get(Turn, turn_id)
            turn.status = status
            turn.reply_text = reply if self.store_text else None
            for k, v in fields.items():
                setattr(turn, k, v)
            turn.rounds.extend(Round(idx=i, **r) for i, r in enumerate(rounds))

    def session_turns(self, session_id: str, with_text: bool = False) -> pd.DataFrame:
        """This session's turns (never another session's), oldest first."""
        cols = TURN_COLUMNS + (["prompt_text", "reply_text"] if with_text else [])
        with Session(self.engine) as s:
            rows = s.scalars(select(Turn).where(Turn.session_id == session_id).order_by(Turn.id)).all()
            return pd.DataFrame([{c: getattr(t, c) for c in cols} for t in rows], columns=cols)

    def turn_rounds(self, turn_id: int) -> pd.DataFrame:
        with Session(self.engine) as s:
            rows = s.scalars(select(Round).where(Round.turn_id == turn_id).order_by(Round.idx)).all()
            cols = ["idx", *ROUND_FIELDS]
            return pd.DataFrame([{c: getattr(r, c) for c in cols} for r in rows], columns=cols)

    def replies(self, target: str, limit: int = 20000) -> list[str]:
        """The newest `limit` finished replies written by a target (oldest first): what lookup drafts from."""
        with Session(self.engine) as s:
            q = (select(Turn.reply_text).where(Turn.target == target, Turn.status == "ok", Turn.reply_text.is_not(None))
                 .order_by(Turn.id.desc()).limit(limit))
            return list(reversed(s.scalars(q).all()))

    def aggregates(self) -> pd.DataFrame:
        """Across all sessions, by preset and mode: counts and means only, never text."""
        with Session(self.engine) as s:
            q = (select(Turn.preset, Turn.mode, func.count(Turn.id), func.count(func.distinct(Turn.session_id)),
                        *(func.avg(getattr(Turn, name)) for name in AVERAGED))
                 .where(Turn.status == "ok").group_by(Turn.preset, Turn.mode).order_by(Turn.preset, Turn.mode))
            cols = ["preset", "mode", "turns", "sessions", *AVERAGED]
            return pd.DataFrame(s.execute(q).all(), columns=cols)

    def all_turns(self) -> pd.DataFrame:
        with Session(self.engine) as s:
            rows = s.scalars(select(Turn).order_by(Turn.id)).all()
            cols = ["session_id"] + TURN_COLUMNS
            return pd.DataFrame([{c: getattr(t, c) for c in cols} for t in rows], columns=cols)


FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Neutralise spreadsheet formula injection: text cells starting with = + - @ TAB CR get a quote."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or pd.api.types.is_string_dtype(out[col]):
            out[col] = out[col].map(lambda v: "'" + v if isinstance(v, str) and v.startswith(FORMULA_PREFIXES) else v)
    return out


def write_csv(df: pd.DataFrame, path: str | Path) -> Path:
    path = Path(path)
    csv_safe(df).to_csv(path, index=False)
    return path
