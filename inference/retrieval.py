"""Retrieval for docs features: chunks, top-k search, the passages in the prompt, and the retrieval cache.

    passages = chunk_markdown(text, count_tokens)          # a document → passages under a token bound
    found = retrieve(feature, user, "how does the guard work?")
    messages = docs_messages(messages, found.chunks)        # before the prompt's tokens are counted

- Chunking: by heading (ATX `#` lines outside code fences), then by paragraph, packed greedily up to
  CHUNK_MAX_TOKENS of the served model's tokenizer; an oversized paragraph is cut at lines, then
  sentences, then words. Each chunk keeps its heading path ("Budgets › The guard").
- Embeddings: the semantic cache's model (inference/web/caches.py, all-MiniLM-L6-v2), unit length, so
  the cosine is a dot product; top-k over the feature's readable chunks with numpy, in process.
- The retrieval cache (Redis) keeps the chunk ids a normalised query found, apart from the answer
  caches, keyed by the feature, its documents' version and the audiences the user may read. A changed
  document bumps the version (bump_version), so older entries are never read again and expire.
  A hit is re-read from the database with the user's audiences once more: a passage the user may
  not read never reaches the prompt, whatever the cache holds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import unicodedata
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import redis

from budgets.redis_clients import cache_url, shared_client

log = logging.getLogger(__name__)

CHUNK_MAX_TOKENS = 200
TOP_K = 3
# Below this cosine a passage is about something else (all-MiniLM-L6-v2 puts unrelated texts near
# 0): it would only spend prompt tokens.
MIN_SCORE = 0.1
CACHE_TTL_S = 3600
KEY_PREFIX = "ceiling:retrieval:"
MATRICES_KEPT = 8  # per process: (feature, version, audiences) → its chunks' embeddings

DOCS_SYSTEM_PROMPT = (
    "Answer the question from the numbered excerpts of the documentation below. Cite the excerpt "
    "you used by its number, like [1]. If the excerpts do not hold the answer, say so."
)

_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


# --- chunking ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Passage:
    heading: str
    text: str


def chunk_markdown(text: str, count_tokens: Callable[[str], int], max_tokens: int = CHUNK_MAX_TOKENS) -> list[Passage]:
    """A document's passages: by heading, then paragraph, each heading + text within max_tokens.

    Plain text (no headings) is one section; a fenced code block is one paragraph, never split at
    its blank lines.
    """
    passages: list[Passage] = []
    for heading, paragraphs in _sections(text):
        budget = max(16, max_tokens - count_tokens(heading) - 1) if heading else max_tokens
        pieces: list[str] = []
        for paragraph in paragraphs:
            pieces += _split_to_fit(paragraph, count_tokens, budget)
        current: list[str] = []
        for piece in pieces:
            candidate = "\n\n".join([*current, piece])
            if current and count_tokens(candidate) > budget:
                passages.append(Passage(heading, "\n\n".join(current)))
                current = [piece]
            else:
                current.append(piece)
        if current:
            passages.append(Passage(heading, "\n\n".join(current)))
    return passages


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading path, its paragraphs) in document order; text before the first heading has path ""."""
    sections: list[tuple[str, list[str]]] = []
    path: list[tuple[int, str]] = []
    paragraphs: list[str] = []
    block: list[str] = []
    in_fence = False

    def end_block() -> None:
        if block and "".join(block).strip():
            paragraphs.append("\n".join(block).strip("\n"))
        block.clear()

    def end_section() -> None:
        end_block()
        if paragraphs:
            sections.append((" › ".join(title for _, title in path), list(paragraphs)))
        paragraphs.clear()

    for line in unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if _FENCE.match(line):
            if not in_fence:
                end_block()
            block.append(line)
            in_fence = not in_fence
            if not in_fence:
                end_block()
            continue
        if in_fence:
            block.append(line)
            continue
        heading = _HEADING.match(line)
        if heading:
            end_section()
            level = len(heading.group(1))
            path = [(lvl, title) for lvl, title in path if lvl < level] + [(level, heading.group(2).strip())]
            continue
        if not line.strip():
            end_block()
        else:
            block.append(line.rstrip())
    end_section()
    return sections


def _split_to_fit(paragraph: str, count_tokens: Callable[[str], int], budget: int) -> list[str]:
    """The paragraph, or its lines, sentences or words packed into pieces of at most budget tokens."""
    if count_tokens(paragraph) <= budget:
        return [paragraph]
    for separator, splitter in (("\n", lambda t: t.split("\n")), (" ", _SENTENCE_END.split), (" ", str.split)):
        parts = [p for p in splitter(paragraph) if p.strip()]
        if len(parts) < 2:
            continue
        pieces: list[str] = []
        current = ""
        for part in parts:
            candidate = f"{current}{separator}{part}" if current else part
            if current and count_tokens(candidate) > budget:
                pieces.append(current)
                current = part
            else:
                current = candidate
        if current:
            pieces.append(current)
        # A part still too long (one huge line, one huge sentence) is cut at the next level down.
        return [small for piece in pieces for small in _split_to_fit(piece, count_tokens, budget)]
    # One "word" longer than the budget (a hash, a URL): cut by characters, a token is rarely under 1.
    step = max(1, budget)
    return [paragraph[i:i + step] for i in range(0, len(paragraph), step)]


def passage_text(document_name: str, heading: str, text: str) -> str:
    """A passage as it is embedded and as it reads in the prompt (after its number)."""
    title = f"{document_name} › {heading}" if heading else document_name
    return f"{title}\n{text}"


def model_token_counter() -> Callable[[str], int]:
    """Tokens in the served model's tokenizer: what the prompt, the guard and the ledger count."""
    from inference.web.tokenizer import get_tokenizer

    tokenizer = get_tokenizer()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def embed_passages(texts: list[str], batch_size: int = 32) -> list[bytes]:
    from inference.web.caches import embed

    # Batches of similar length: a batch is padded to its longest text.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out: list[bytes] = [b""] * len(texts)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        for i, vector in zip(batch, embed([texts[i] for i in batch]), strict=True):
            out[i] = vector.astype(np.float32).tobytes()
    return out


# --- who may read what ---------------------------------------------------------------------------


def audiences_for(user) -> tuple[str, ...]:
    """The document audiences a user may read, sorted: staff read every document (every team's
    too), others the "everyone" ones and those of each team they are in."""
    from budgets.models import Team, TeamMembership
    from inference.models import Document

    if getattr(user, "is_staff", False):
        teams = [Document.team_audience(pk) for pk in Team.objects.values_list("pk", flat=True)]
        return tuple(sorted([Document.Audience.EVERYONE, Document.Audience.STAFF, *teams]))
    team_ids = TeamMembership.objects.filter(user_id=user.pk).values_list("team_id", flat=True)
    return tuple(sorted([Document.Audience.EVERYONE, *(Document.team_audience(team_id) for team_id in team_ids)]))


def normalise_query(text: str) -> str:
    """Same question, same search: Unicode NFC, case folded, whitespace collapsed, end punctuation dropped."""
    folded = " ".join(unicodedata.normalize("NFC", text).casefold().split())
    return folded.strip(" ?!.,;:")


# --- search and the retrieval cache ---------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """One retrieved passage, as it goes into the prompt."""

    chunk_id: int
    document: str
    heading: str
    text: str
    score: float

    @property
    def prompt_text(self) -> str:
        return passage_text(self.document, self.heading, self.text)


@dataclass
class Retrieval:
    chunks: list[Found] = field(default_factory=list)
    ms: int = 0
    cache: str = ""  # "hit" | "miss" | "" (the cache could not be asked)
    saved_ms: int = 0  # on a hit: what the search it replays took, less what the hit took
    embedded: bool = False  # the query was embedded (never on a hit)


def _client() -> redis.Redis:
    # On CEILING_CACHE_URL (else the counters' Redis), one Redis or a cluster: every command here touches one key.
    return shared_client(cache_url(), 0.5)


def _version_key(feature_id: int) -> str:
    return f"{KEY_PREFIX}version:{feature_id}"


def cache_key(feature_id: int, version: str, audiences: tuple[str, ...], k: int, query: str) -> str:
    digest = hashlib.sha256(normalise_query(query).encode()).hexdigest()
    scope = "+".join(audiences)
    if len(scope) > 64:  # staff read every team's documents: a long list, kept short in the key
        scope = "h" + hashlib.sha256(scope.encode()).hexdigest()[:24]
    return f"{KEY_PREFIX}{feature_id}:v{version}:{scope}:k{k}:{digest}"


def _new_version() -> str:
    # Never a counter from 0: after Redis lost its keys, a version must not repeat one that a
    # process still holds embeddings for (_matrices), or that process would search old chunks.
    return uuid.uuid4().hex[:12]


def current_version(client: redis.Redis, feature_id: int) -> str:
    """The feature's documents version; a fresh one when Redis has none (first use, or after a flush)."""
    key = _version_key(feature_id)
    version = client.get(key)
    if version is None:
        client.set(key, _new_version(), nx=True)
        version = client.get(key)
    return version.decode() if isinstance(version, bytes) else str(version)


_unreachable_said = threading.Event()


def bump_version(feature_id: int) -> None:
    """A document of the feature changed: every cached search of it is stale from now on."""
    try:
        _client().set(_version_key(feature_id), _new_version())
    except (redis.RedisError, OSError) as exc:
        # Entries written before still expire within CACHE_TTL_S; the hit path also re-reads the
        # chunks, so a deleted passage is never served, only a changed ranking could be. Said once
        # per process: `make run` loads the docs before it starts its private Redis, and fifteen
        # identical warnings on a first start read as fifteen failures.
        level = logging.DEBUG if _unreachable_said.is_set() else logging.WARNING
        _unreachable_said.set()
        log.log(level, "retrieval cache: could not bump the version of feature %s (%s); cached searches "
                "expire within %s s anyway", feature_id, exc, CACHE_TTL_S)


def retrieve(feature, user, query: str, k: int = TOP_K) -> Retrieval:
    """The top-k passages of the feature's documents the user may read, from the cache when it has them."""
    started = time.perf_counter()
    audiences = audiences_for(user)
    client = _client()
    key = version = None
    try:
        version = current_version(client, feature.pk)
        key = cache_key(feature.pk, version, audiences, k, query)
        raw = client.get(key)
    except (redis.RedisError, OSError, ValueError) as exc:
        log.warning("retrieval cache lookup failed: %s", exc)
        raw = None
    if raw is not None:
        entry = json.loads(raw)
        chunks = _load(feature, audiences, entry["ids"], entry["scores"])
        ms = _ms_since(started)
        return Retrieval(chunks, ms, "hit", max(0, int(entry["ms"]) - ms), embedded=False)
    ids, scores = _search(feature, audiences, version, query, k)
    chunks = _load(feature, audiences, ids, scores)
    ms = _ms_since(started)
    if key is None:
        return Retrieval(chunks, ms, "", 0, embedded=True)
    try:
        client.set(key, json.dumps({"ids": ids, "scores": scores, "ms": ms}), ex=CACHE_TTL_S)
    except (redis.RedisError, OSError) as exc:
        log.warning("retrieval cache store failed: %s", exc)
    return Retrieval(chunks, ms, "miss", 0, embedded=True)


def _ms_since(started: float) -> int:
    return int(round((time.perf_counter() - started) * 1000))


def _search(feature, audiences: tuple[str, ...], version: str | None, query: str, k: int) -> tuple[list[int], list[float]]:
    from inference.web.caches import embed

    ids, matrix = _matrix(feature.pk, audiences, version)
    if not ids:
        return [], []
    vector = embed([query])[0]
    scores = matrix @ vector  # unit vectors: the dot product is the cosine
    top = [i for i in np.argsort(-scores)[:k] if scores[i] >= MIN_SCORE]
    return [ids[i] for i in top], [round(float(scores[i]), 4) for i in top]


_matrices: OrderedDict[tuple, tuple[list[int], np.ndarray]] = OrderedDict()


def _matrix(feature_id: int, audiences: tuple[str, ...], version: str | None) -> tuple[list[int], np.ndarray]:
    """The ids and embeddings of the chunks the audiences may read; kept per version when it is known."""
    from inference.models import Chunk

    memo = (feature_id, version, audiences)
    if version is not None and memo in _matrices:
        _matrices.move_to_end(memo)
        return _matrices[memo]
    rows = list(
        Chunk.objects.filter(document__feature_id=feature_id, document__audience__in=audiences)
        .order_by("id").values_list("id", "embedding")
    )
    ids = [pk for pk, _ in rows]
    matrix = np.stack([np.frombuffer(bytes(blob), dtype=np.float32) for _, blob in rows]) if rows else np.zeros((0, 0))
    if version is not None:
        _matrices[memo] = (ids, matrix)
        while len(_matrices) > MATRICES_KEPT:
            _matrices.popitem(last=False)
    return ids, matrix


def _load(feature, audiences: tuple[str, ...], ids: list[int], scores: list[float]) -> list[Found]:
    """The chunks by id, in the given order, only those of the feature the audiences may read."""
    from inference.models import Chunk

    if not ids:
        return []
    rows = Chunk.objects.filter(pk__in=ids, document__feature=feature, document__audience__in=audiences).select_related("document")
    by_id = {row.pk: row for row in rows}
    return [
        Found(pk, by_id[pk].document.name, by_id[pk].heading, by_id[pk].text, score)
        for pk, score in zip(ids, scores, strict=True) if pk in by_id
    ]


# --- the prompt ----------------------------------------------------------------------------------


def context_text(chunks: list[Found]) -> str:
    """The numbered passages as they follow the instruction in the system prompt."""
    return "\n\n".join(f"[{n}] {chunk.prompt_text}" for n, chunk in enumerate(chunks, start=1))


def docs_messages(messages: list[dict], chunks: list[Found]) -> list[dict]:
    """The conversation with the instruction and the passages as its system prompt (joined to one given)."""
    context = context_text(chunks) if chunks else "(No document of this feature matches the question.)"
    system = f"{DOCS_SYSTEM_PROMPT}\n\n{context}"
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{system}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": system}, *messages]


def last_question(messages: list[dict]) -> str:
    """What is searched for: the conversation's last user message."""
    for message in reversed(messages):
        if message["role"] == "user":
            return message["content"]
    return ""


# --- what may be uploaded ------------------------------------------------------------------------

MAX_DOCUMENT_BYTES = 512 * 1024
DOCUMENT_EXTENSIONS = (".md", ".markdown", ".txt")
DOCUMENT_CONTENT_TYPES = ("text/markdown", "text/x-markdown", "text/plain", "application/octet-stream", "")


class DocumentRejected(ValueError):
    """A file that cannot be a document; the message says why in a sentence."""


def document_text(name: str, raw: bytes, content_type: str = "") -> str:
    """The text of an uploaded Markdown or text file, or DocumentRejected saying what is wrong with it."""
    if not name.lower().endswith(DOCUMENT_EXTENSIONS):
        raise DocumentRejected(f"{name!r} is not a Markdown or text file: use a .md, .markdown or .txt file.")
    if content_type.split(";")[0].strip().lower() not in DOCUMENT_CONTENT_TYPES:
        raise DocumentRejected(f"{name!r} was sent as {content_type!r}, not as text: upload a Markdown or text file.")
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise DocumentRejected(
            f"{name!r} is {len(raw) / 1024:,.0f} KiB; a document may be at most {MAX_DOCUMENT_BYTES // 1024:,} KiB. "
            "Split it into several files."
        )
    if b"\x00" in raw:
        raise DocumentRejected(f"{name!r} holds binary data (NUL bytes), not text.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DocumentRejected(f"{name!r} is not UTF-8 text (byte {exc.start:,} cannot be read): save it as UTF-8.") from exc
    if not text.strip():
        raise DocumentRejected(f"{name!r} is empty: there is nothing to answer from.")
    return text
