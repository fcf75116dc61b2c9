"""The lifecycle of one chat request: opened by the consumer, finished by the worker."""

from __future__ import annotations

import hashlib
from functools import partial

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from budgets.actions import Usage, do_record_usage, do_save_with_audit, snapshot
from budgets.alerts import check_thresholds_after_settle
from budgets.guard import AdmissionRequest, Decision, Fallback, LoopLimits, admit, settle
from budgets.models import AuditEntry, Feature, RetrievalFacts, TokenLog, unique_row

from . import retrieval
from .models import Chunk, Document, ModelAlias, QuantizationEvaluation, QuantizationPolicy, Transcript
from .variants import shipped_verdict_applies


def do_admit_request(
    *,
    request_id: str,
    user: AbstractBaseUser,
    feature: Feature,
    model: str,
    messages: list[dict],
    prompt_ids: list[int],
    max_tokens: int,
    prompt_tokens: int | None = None,
    loop: LoopLimits | None = None,
    params: dict | None = None,
    end_user: str = "",
    fallback: Fallback | None = None,
    retrieved: RetrievalFacts | None = None,
    api_key=None,
    tags: tuple[str, ...] = (),
    team: str = "",
) -> Decision:
    """Ask the guard; when admitted, store the prompt for the worker. Refusals are logged by the guard.

    With a fallback the guard may admit the request there instead (decision.fell_back_to); the row
    then names the fallback's feature, provider and model, which is what the worker serves it with.
    prompt_tokens: what the guard reserves for the prompt, when it is not len(prompt_ids) (a remote's
    estimate, which has no local ids).
    """
    request = AdmissionRequest(
        request_id=request_id,
        user=user,
        feature=feature,
        model=model,
        prompt_tokens=len(prompt_ids) if prompt_tokens is None else prompt_tokens,
        max_tokens=max_tokens,
        loop=loop,
        fallback=fallback,
        retrieval=retrieved,
        api_key=api_key,
        tags=tags,
        team=team,
    )
    decision = admit(request)
    if decision.admitted:
        store_prompt(decision.log, messages, prompt_ids, params or {}, end_user)
    return decision


def store_prompt(log: TokenLog, messages: list[dict], prompt_ids: list[int], params: dict | None = None,
                 end_user: str = "") -> Transcript:
    """What the worker will read: the prompt of an admitted request, and how to sample its answer."""
    return Transcript.objects.create(log=log, messages=messages, prompt_ids=prompt_ids, params=params or {}, end_user=end_user)


@transaction.atomic
def do_finish_request(
    request_id: str,
    *,
    status: str,
    prompt_tokens: int,
    completion_ids: list[int],
    text: str,
    finish_reason: str,
    ttft_ms: int | None,
    error: str = "",
    completion_tokens: int | None = None,
    admitted: TokenLog | None = None,
) -> TokenLog | None:
    """Settle the ledger row and store the answer; None when it was already settled.

    admitted: the row as the worker read it when it started (do_record_usage need not read it again).

    completion_tokens defaults to len(completion_ids); a remote engine has no local token ids and
    passes the count it reported instead. The guard's counters are settled by the caller after this
    commits (settle_reservation).
    """
    if completion_tokens is None:
        completion_tokens = len(completion_ids)
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    settled = do_record_usage(
        request_id, status=status, usage=usage, finish_reason=finish_reason, error=error, ttft_ms=ttft_ms,
        admitted=admitted,
    )
    if settled is None:
        return None
    Transcript.objects.filter(log__request_id=request_id).update(completion_ids=completion_ids, response_text=text)
    return settled  # as the usage's UPDATE … RETURNING left it: the transcript is another table


# The ledger's error and the user's message for a request whose worker died mid-way.
WORKER_LOST_ERROR = "the worker running it stopped after {tokens} tokens"
WORKER_LOST_MESSAGE = ("The worker generating this answer stopped unexpectedly after {tokens} tokens "
                       "(those are counted; the rest is not). Please try again.")


def worker_lost_event(request_id: str, tokens: int) -> dict:
    """The protocol's `error` event (code worker_lost) for such a request."""
    return {"type": "error", "request_id": request_id, "code": "worker_lost", "message": WORKER_LOST_MESSAGE.format(tokens=tokens)}


def do_fail_lost_request(request_id: str, *, tokens: int, text: str = "", prompt_tokens: int | None = None,
                         error: str = "") -> TokenLog | None:
    """Settle a request whose worker died: failed, with the tokens that worker recorded as streamed
    (inference/bus/ownership.py), its ownership record dropped and its reservation released.

    None when it was settled already (by its worker, a web process or another sweeping worker): the
    first one wins, the others change nothing. text: what the waiting web process received, if any;
    error: the ledger's reason, when it is not a dead worker's.
    """
    from .bus.ownership import release_claim

    row = unique_row(TokenLog.objects.filter(request_id=request_id))
    if row is None:
        return None  # not a request of this ledger: its record expires by itself
    settled = None
    if row.status == TokenLog.Status.RUNNING:
        settled = do_finish_request(
            request_id, status=TokenLog.Status.FAILED,
            prompt_tokens=row.prompt_tokens if prompt_tokens is None else prompt_tokens, completion_ids=[],
            completion_tokens=tokens, text=text, finish_reason="", ttft_ms=None,
            error=error or WORKER_LOST_ERROR.format(tokens=tokens),
        )
    release_claim(request_id)
    if settled is not None:
        settle_reservation(request_id)
    return settled


def settle_reservation(request_id: str) -> bool:
    """Release a finished request's reservation in the guard; safe to call any number of times."""
    row = unique_row(TokenLog.objects.select_related("provider").filter(request_id=request_id))
    if row is None or row.status in (TokenLog.Status.RUNNING, TokenLog.Status.REFUSED) or not row.admitted:
        return False
    settled = settle(row)
    if settled:
        check_thresholds_after_settle(row)  # the provider's and the team's; logs, never raises
    return settled


# --- quantized weights: evaluations and the switch they gate --------------------------------------


class SwitchRefused(Exception):
    """Staff may not switch the feature to these weights; the message says why."""


def do_record_evaluation(feature: Feature, mode: str, run, prompt_set_size: int,
                         machine: str | None = None) -> QuantizationEvaluation:
    """Store one evaluate_quantization run with the verdict under the staff's thresholds of now.

    machine: where it was measured; by default this machine, since the process that measured a run
    is the one that records it.
    """
    from .engine.evaluate import verdict
    from .engines import this_machine

    policy = QuantizationPolicy.current()
    row = QuantizationEvaluation(
        feature=feature,
        mode=mode,
        machine=this_machine() if machine is None else machine,
        prompt_set_size=prompt_set_size,
        checkable=run.scores.checkable,
        baseline_correct=run.scores.baseline_correct,
        candidate_correct=run.scores.candidate_correct,
        agreement=run.scores.agreement,
        baseline_tokens_per_s=run.baseline_tokens_per_s,
        candidate_tokens_per_s=run.candidate_tokens_per_s,
        workload_requests=run.workload_requests,
        baseline_weights_bytes=run.baseline_weights_bytes,
        candidate_weights_bytes=run.candidate_weights_bytes,
        max_accuracy_drop_points=policy.max_accuracy_drop_points,
        min_throughput_gain_pct=policy.min_throughput_gain_pct,
        answers=run.answers,
    )
    row.passed, row.verdict = verdict(
        row.baseline_accuracy, row.candidate_accuracy, row.baseline_tokens_per_s, row.candidate_tokens_per_s,
        policy.max_accuracy_drop_points, policy.min_throughput_gain_pct,
    )
    if not row.complete:
        row.passed = False  # the verdict's numbers hold for the subset only
        row.verdict += f" Ran on {row.answered} of {prompt_set_size} prompts: a partial run cannot approve a switch."
    row.save()
    return row


def switch_refusal(feature: Feature, mode: str) -> str | None:
    """Why the feature may not be served by `mode` weights now; None when it may.

    Going back to full precision is always allowed. Anything else needs the latest evaluation of
    that mode on this feature to have passed on the whole prompt set.
    """
    if mode == Feature.Quantization.NONE:
        return None
    if mode not in Feature.Quantization.values:
        return f"{mode!r} is not a weight variant this stack serves."
    return evaluation_refusal(feature, mode, QuantizationEvaluation.latest_for(feature, mode))


def evaluation_refusal(feature: Feature, mode: str, latest: QuantizationEvaluation | None) -> str | None:
    """switch_refusal's verdict from `mode`'s latest evaluation, for a caller that has read it already."""
    command = f"python manage.py evaluate_quantization --feature {feature.name} --mode {mode}"
    if latest is None and shipped_verdict_applies(mode):
        return None  # the verdict shipped with the bundled model stands until an evaluation here replaces it
    if latest is None:
        return f"No {mode} evaluation of {feature.name} has been run yet: run `{command}` first."
    when = f"{latest.created_at:%Y-%m-%d %H:%M}"
    if not latest.complete:
        return (
            f"The latest {mode} evaluation of {feature.name} ({when}) answered only {latest.answered} of "
            f"{latest.prompt_set_size} prompts; run `{command}` on the whole set."
        )
    if not latest.passed:
        return f"The latest {mode} evaluation of {feature.name} ({when}) failed. {latest.verdict}"
    return None


def do_switch_quantization(actor: AbstractBaseUser | None, feature: Feature, mode: str) -> list:
    """Serve the feature with `mode` weights from its next request on; audited like other config changes.

    A person's switch (an actor) also pins the feature: the start-up's adoption of the shipped verdict
    (inference/shipped.py) never overrides what staff chose. A command's (no actor) pins nothing.
    """
    refusal = switch_refusal(feature, mode)
    if refusal:
        raise SwitchRefused(refusal)
    fields = ["quantization", "quantization_pinned"]
    before = snapshot(feature, fields)
    feature.quantization = mode
    if actor is not None:
        feature.quantization_pinned = True
    return do_save_with_audit(actor, feature, fields, before, target=f"feature {feature.name}")


# --- model aliases: which feature a request's "model" selects ---------------------------------------


@transaction.atomic
def do_set_model_aliases(actor: AbstractBaseUser | None, feature: Feature, names: list[str]) -> AuditEntry | None:
    """The feature's aliases become exactly `names` (audited); None when nothing changed.

    An alias taken meanwhile by another feature raises IntegrityError (the unique index decides).
    """
    before = list(feature.model_aliases.order_by("name").values_list("name", flat=True))
    if sorted(names) == before:
        return None
    feature.model_aliases.exclude(name__in=names).delete()
    ModelAlias.objects.bulk_create([ModelAlias(name=name, feature=feature) for name in names if name not in before])
    return AuditEntry.objects.create(
        actor=actor, action="update", target=f"feature {feature.name}", field="model_aliases",
        before=", ".join(before) or "none", after=", ".join(sorted(names)) or "none",
    )


# --- documents of a docs feature ------------------------------------------------------------------


def do_save_document(
    actor: AbstractBaseUser | None, feature: Feature, name: str, text: str, audience: str = Document.Audience.EVERYONE,
    *, count_tokens=None,
) -> tuple[Document, bool]:
    """Add or replace the feature's document `name`, chunked and embedded; (document, changed).

    The same text and audience again change nothing (load_docs may run at every start). A change
    bumps the feature's retrieval-cache version after commit, so no cached search serves old passages.
    """
    sha = hashlib.sha256(text.encode()).hexdigest()
    existing = Document.objects.filter(feature=feature, name=name).first()
    if existing is not None and existing.sha256 == sha and existing.audience == audience:
        return existing, False
    # Chunked and embedded before the transaction: seconds of model work hold no row lock.
    count_tokens = count_tokens or retrieval.model_token_counter()
    passages = retrieval.chunk_markdown(text, count_tokens)
    prompt_texts = [retrieval.passage_text(name, p.heading, p.text) for p in passages]
    embeddings = retrieval.embed_passages(prompt_texts)
    with transaction.atomic():
        document, created = Document.objects.update_or_create(
            feature=feature, name=name, defaults={"text": text, "sha256": sha, "audience": audience},
        )
        document.chunks.all().delete()
        Chunk.objects.bulk_create([
            Chunk(document=document, index=i, heading=p.heading[:500], text=p.text, tokens=count_tokens(t), embedding=e)
            for i, (p, t, e) in enumerate(zip(passages, prompt_texts, embeddings, strict=True))
        ])
        AuditEntry.objects.create(
            actor=actor, action="create" if created else "update", target=f"feature {feature.name}",
            field="document", before="" if created else name, after=f"{name} ({audience}, {len(passages)} chunks)",
        )
        transaction.on_commit(partial(retrieval.bump_version, feature.pk))
    return document, True


def do_delete_document(actor: AbstractBaseUser | None, document: Document) -> None:
    feature = document.feature
    with transaction.atomic():
        AuditEntry.objects.create(
            actor=actor, action="delete", target=f"feature {feature.name}", field="document", before=document.name, after="",
        )
        document.delete()
        transaction.on_commit(partial(retrieval.bump_version, feature.pk))
