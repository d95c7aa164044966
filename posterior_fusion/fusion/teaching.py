"""Distillation that teaches one network what a global artifact's predictive knows (``fuse --distill``,
recipe ``consistent``, and ``data-free`` with no server inputs at all).

**Consistent teaching** (Beyer et al. 2022, "patient and consistent"): at every step the teacher — the members'
softmax combined exactly as the artifact predicts (the label-shift pool, the average, the mixture) — is
evaluated on the very batch the student sees, after the augmentation, never on cached clean inputs. The
augmentations by input kind: images ``(n, C, H, W)`` a random shift (crop of the zero-padded image by
``pad`` pixels), a horizontal flip where it is label-preserving — decided on the data, as whether the teacher's
top class agrees on flipped and unflipped held-out inputs for at least :data:`FLIP_AGREEMENT` of them — and
mixup between inputs of the batch (λ ~ Beta(``mixup``, ``mixup``)) or CutMix (``cutmix``, :func:`cutmix`; with
both, one of the two per batch at random); vectors and token ids mixup only where
they are real-valued (token ids: none). The loss is the KL divergence from the teacher to the student at
``temperature`` (times T², so its gradient's scale does not depend on T); Adam with a cosine schedule for
``steps`` steps (``views`` > 0: each input's augmented views are drawn and taught once, ``views`` of them, and
every step's batch is drawn from that cache: the teacher's cost no longer grows with ``steps``); the student starts from scratch (the spec's initialisation at ``seed``) or from the member
whose prediction agrees most with the teacher's; an exponential moving average of its weights (``ema``) is
the result. A tenth of the inputs (at least 50) is held out: the student's top-1 agreement with the teacher
there is logged as it trains and recorded.

**Data-free** (no server inputs): the inputs are synthesised from what the artifacts already hold
(:mod:`~posterior_fusion.fusion.synthesis`), then feed the consistent recipe.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from posterior_fusion.budget import require
from posterior_fusion.errors import ConfigError, ModelSpecError
from posterior_fusion.fusion import teaching_checkpoint as checkpoints
from posterior_fusion.fusion.distill_settings import TeachingConfig
from posterior_fusion.fusion.synthesis import (
    check_expand_factors,
    client_input_moment,
    layer_factors,
    pooled_input_moment,
    synthesise,
    synthetic_input_shape,
)
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.functional import batched_logits
from posterior_fusion.pooling import AVERAGE, Pooling
from posterior_fusion.progress import progress

FLIP_AGREEMENT = 0.95  # the teacher's top class on flipped inputs agrees this often: the flip is label-preserving


def teacher_probabilities(spec: ModelSpec, members: torch.Tensor, pooling: Pooling = AVERAGE,
                          weights: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x (b, ...) ↦`` the artifact's predictive ``(b, classes)`` on ``x``: the members ``(K, d)`` in
    evaluation mode, their softmax combined by ``pooling`` (with mixture ``weights``)."""
    def teach(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return pooling.combine(torch.softmax(batched_logits(spec, members, x), -1), weights).float()
    return teach


def flip_preserves_labels(teach: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[bool, float]:
    """Whether a horizontal flip keeps the teacher's top class on ``x`` (images): ``(decision, agreement)``."""
    if x.ndim != 4:
        return False, 0.0
    same = float((teach(x).argmax(-1) == teach(x.flip(-1)).argmax(-1)).double().mean())
    return same >= FLIP_AGREEMENT, same


def augment(x: torch.Tensor, cfg: TeachingConfig, flip: bool, gen: torch.Generator, integral: bool) -> torch.Tensor:
    """One augmented view of the batch ``x`` (module doc): shift and flip for images, then mixup."""
    out = x
    if x.ndim == 4 and cfg.pad > 0:
        b, _, h, w = x.shape
        padded = nn.functional.pad(x, (cfg.pad,) * 4)
        dy = torch.randint(0, 2 * cfg.pad + 1, (b,), generator=gen).tolist()
        dx = torch.randint(0, 2 * cfg.pad + 1, (b,), generator=gen).tolist()
        out = torch.stack([padded[i, :, dy[i]: dy[i] + h, dx[i]: dx[i] + w] for i in range(b)])
    if flip and x.ndim == 4:
        mask = torch.rand(x.shape[0], generator=gen) < 0.5
        out = torch.where(mask[:, None, None, None], out.flip(-1), out)
    mixup = cfg.mixup > 0 and not integral
    if cfg.cutmix > 0 and x.ndim == 4 and (not mixup or bool(torch.rand((), generator=gen) < 0.5)):
        return cutmix(out, cfg.cutmix, gen)
    if mixup:
        lam = torch.distributions.Beta(cfg.mixup, cfg.mixup).sample((x.shape[0],)).clamp(0, 1)
        order = torch.randperm(x.shape[0], generator=gen)
        shape = (-1,) + (1,) * (x.ndim - 1)
        out = lam.reshape(shape) * out + (1 - lam.reshape(shape)) * out[order]
    return out


def cutmix(x: torch.Tensor, a: float, gen: torch.Generator) -> torch.Tensor:
    """CutMix within the batch of images ``x`` ``(b, C, H, W)`` (Yun et al. 2019): each image takes a box of another
    of the batch, of side ``√(1 − λ)`` times its own, centred at a uniform pixel and cut at the edges,
    λ ~ Beta(a, a)."""
    b, _, h, w = x.shape
    lam = torch.distributions.Beta(a, a).sample((b,)).clamp(0, 1)
    order = torch.randperm(b, generator=gen)
    cy, cx = torch.randint(0, h, (b,), generator=gen), torch.randint(0, w, (b,), generator=gen)
    out = x.clone()
    for i, (side, y, z) in enumerate(zip((1 - lam).sqrt().tolist(), cy.tolist(), cx.tolist())):
        dh, dw = round(side * h / 2), round(side * w / 2)
        y0, y1, z0, z1 = max(y - dh, 0), min(y + dh, h), max(z - dw, 0), min(z + dw, w)
        out[i, :, y0:y1, z0:z1] = x[order[i], :, y0:y1, z0:z1]
    return out


def check_view_cache(cfg: TeachingConfig, n: int, input_size: int, classes: int,
                     max_memory: int | str | None = None) -> None:
    """Refuse, in one line, a cache of ``cfg.views`` views of ``n`` inputs of ``input_size`` values (float32, with
    the teacher's ``classes`` probabilities each) over the memory limit."""
    if cfg.views:
        require(cfg.views * n * 4 * (input_size + classes),
                f"the distillation's cache of {cfg.views} views of {n} inputs (`distill_views`)", max_memory)


def view_cache(x: torch.Tensor, cfg: TeachingConfig, flip: bool, gen: torch.Generator, integral: bool,
               teach_fn: Callable[[torch.Tensor], torch.Tensor], classes: int, show_progress: bool = True,
               max_memory: int | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cfg.views`` augmented views of every input of ``x`` ``(n, ...)`` (batches of ``cfg.batch_size`` in a fresh
    order per round, mixup within each) and the teacher on each: ``(views·n, ...)``, ``(views·n, classes)``;
    refused before any is made where they would take more than ``max_memory``."""
    n = x.shape[0]
    check_view_cache(cfg, n, x[0].numel(), classes, max_memory)
    xs, ts = [], []
    for _ in progress(range(cfg.views), "distill (teaching the cached views)", show=show_progress):
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, cfg.batch_size):
            view = augment(x[order[i: i + cfg.batch_size]], cfg, flip, gen, integral)
            xs.append(view)
            ts.append(teach_fn(view))
    return torch.cat(xs), torch.cat(ts)


def _agreement(student: nn.Module, x: torch.Tensor, target: torch.Tensor) -> float:
    with torch.no_grad():
        was = student.training
        student.eval()
        agree = float((student(x).argmax(-1) == target).double().mean())
        student.train(was)
    return agree


def teach(spec: ModelSpec, members: torch.Tensor, x: torch.Tensor, cfg: TeachingConfig | None = None,
          pooling: Pooling = AVERAGE, weights: torch.Tensor | None = None, student: ModelSpec | None = None,
          show_progress: bool = True, teacher: Callable[[torch.Tensor], torch.Tensor] | None = None,
          log: Callable[[str], None] = lambda m: None, checkpoint: str | os.PathLike | None = None,
          synthetic_key: str | None = None, synthesis: dict | None = None,
          max_memory: int | str | None = None) -> tuple[torch.Tensor, dict]:
    """One network ``(d,)`` of ``student`` (default ``spec``) taught by the members ``(K, d)`` of ``spec``
    combined by ``pooling``, on the inputs ``x`` ``(n, ...)`` (module doc, "Consistent teaching"); and a record
    (the recipe, the flip decision, the held-out agreement). ``teacher``: any ``x ↦ probabilities`` instead.
    ``checkpoint``: a file where the run's state is kept every tenth of the schedule and from which an
    interrupted run of the same recipe, teachers and inputs resumes to the same result
    (:mod:`~posterior_fusion.fusion.teaching_checkpoint`); ``synthetic_key``: ``x`` was synthesised by the run of
    that fingerprint, which names the checkpoint, and is kept in it with ``synthesis``, its record; ``max_memory``:
    the limit of the cached views (:func:`view_cache`)."""
    cfg = cfg or TeachingConfig()
    cfg.validate()
    student = student or spec
    key = synthetic_key or (checkpoints.fingerprint("consistent", cfg.to_json(), spec.to_json(), student.to_json(),
                                                    repr(pooling), weights, members, x) if checkpoint is not None else "")
    synthetic = x if synthetic_key else None
    teach_fn = teacher or teacher_probabilities(spec, members, pooling, weights)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = x.shape[0]
    if n < 4:
        raise ConfigError(f"distillation needs at least 4 inputs, got {n}")
    held = max(min(50, n // 2), n // 10)
    perm = torch.randperm(n, generator=gen)
    held_x, train_x = x[perm[:held]], x[perm[held:]]
    held_probs = teach_fn(held_x)
    held_top = held_probs.argmax(-1)
    # token ids (integral vectors) take no mixup: an average of two ids is no token
    integral = not x.is_floating_point() or (x.ndim == 2 and bool(torch.equal(x[:64], x[:64].round())))
    flip = {"on": True, "off": False}.get(cfg.flip)
    flip_agreement = None
    if flip is None:
        flip, flip_agreement = flip_preserves_labels(teach_fn, held_x)
    torch.manual_seed(cfg.seed)
    model = student.build()
    start = "scratch"
    if cfg.start == "member" and student == spec:
        agree = [float((batched_logits(spec, members[k: k + 1], held_x)[0].argmax(-1) == held_top).double().mean())
                 for k in range(members.shape[0])]
        best = max(range(len(agree)), key=agree.__getitem__)
        vector_to_parameters(members[best].detach().clone().float(), model.parameters())
        start = f"member {best}"
    model.train()
    cache = (view_cache(train_x, cfg, flip, gen, integral, teach_fn, held_probs.shape[-1], show_progress, max_memory)
             if cfg.views else None)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(1.0, t / cfg.steps))))
    average = parameters_to_vector(model.parameters()).detach().clone()
    T = cfg.temperature
    every = max(1, cfg.steps // 10)
    history, done = [], 0
    resumed = checkpoints.restore(checkpoint, key, model, opt, gen) if checkpoint is not None else None
    if resumed is not None:
        done, average, history = resumed
        sched.last_epoch = done  # the schedule's closed form at the step reached
        for group in opt.param_groups:
            group["lr"] = cfg.lr * sched.lr_lambdas[0](done)
        log(f"distill: resuming at step {done} of {cfg.steps} from {checkpoint}")
    elif synthetic is not None:  # the synthetic inputs are kept before the first step
        checkpoints.save(checkpoint, key, 0, model, opt, average, gen, history, synthetic, synthesis)
    bar = progress(range(done, cfg.steps), "distill (consistent)", total=cfg.steps - done, show=show_progress)
    for step in bar:
        if cache is None:
            idx = torch.randint(0, train_x.shape[0], (min(cfg.batch_size, train_x.shape[0]),), generator=gen)
            view = augment(train_x[idx], cfg, flip, gen, integral)
            target = teach_fn(view)  # the teacher on the student's exact view
        else:
            idx = torch.randint(0, cache[0].shape[0], (min(cfg.batch_size, cache[0].shape[0]),), generator=gen)
            view, target = cache[0][idx], cache[1][idx]  # a cached view and the teacher on it
        logits = model(view)
        loss = T * T * nn.functional.kl_div(torch.log_softmax(logits / T, -1),
                                            torch.softmax(target.clamp_min(1e-12).log() / T, -1),
                                            reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            w = parameters_to_vector(model.parameters())
            average = w.detach().clone() if cfg.ema == 0 else cfg.ema * average + (1 - cfg.ema) * w.detach()
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            probe = student.build()
            vector_to_parameters(average.clone(), probe.parameters())
            agreement = _agreement(probe, held_x, held_top)
            history.append({"step": step + 1, "loss": float(loss.detach()), "agreement": agreement})
            log(f"distill: step {step + 1}/{cfg.steps}, loss {float(loss.detach()):.4f}, held-out agreement {agreement:.4f}")
            if checkpoint is not None and step + 1 < cfg.steps:
                checkpoints.save(checkpoint, key, step + 1, model, opt, average, gen, history, synthetic, synthesis)
    return average.detach().clone(), {
        "recipe": "consistent", "config": cfg.to_json(), "start": start, "flip": flip,
        **({"flip_agreement": round(flip_agreement, 6)} if flip_agreement is not None else {}),
        "teachers": int(members.shape[0]), "held_out": held, "agreement": history[-1]["agreement"],
        "history": history, "student": student.to_json()}


def student_spec(cfg: TeachingConfig, spec: ModelSpec, input_shape: tuple[int, ...]) -> ModelSpec:
    """The student's model: the clients' ``spec``, or the one the setting ``student`` names, fitted to the
    inputs ``input_shape`` and the clients' classes and trained whole; refused in one line where it does not fit."""
    if not cfg.student:
        return spec
    text = cfg.student.strip()
    where = f"the distillation's student {text[:80]!r} (`distill_student`)"
    try:
        named = ModelSpec.from_json(text) if text.startswith("{") else ModelSpec(text, {})
        if named.finetune != "all":
            raise ModelSpecError("a student is trained whole: leave out its finetune")
        student = named.fitted_to(tuple(input_shape), spec.num_classes, "its inputs")
        student.check_input(tuple(input_shape), "its inputs")
    except ModelSpecError as exc:
        raise ModelSpecError(f"{where}: {str(exc).replace('`model_kwargs`', 'its kwargs')}") from None
    return student


def teach_members(spec: ModelSpec, members: list[torch.Tensor], x: torch.Tensor | None, cfg: TeachingConfig,
                  pooling: Pooling, weights: torch.Tensor | None, clients=(), show_progress: bool = True,
                  log: Callable[[str], None] = lambda m: None,
                  checkpoint: str | os.PathLike | None = None,
                  student: ModelSpec | None = None, max_memory: int | str | None = None) -> tuple[torch.Tensor, dict]:
    """:func:`teach` on the server's inputs ``x``, or without them (``x`` None) on inputs synthesised from the
    teacher and the ``clients``' first-layer input factors (:func:`synthesise`; one input's shape from ``cfg`` or
    the clients' records). ``checkpoint``: :func:`teach`'s (a data-free run keeps its synthetic inputs there);
    ``student``: the student's model (:func:`student_spec`) [default: ``spec``]; ``max_memory``: :func:`teach`'s."""
    import hashlib

    teachers = torch.stack([m.float() for m in members])
    teacher = teacher_probabilities(spec, teachers, pooling, weights)
    record: dict = {}
    synthetic_key = None
    digest = hashlib.sha256(teachers.contiguous().numpy().tobytes()).hexdigest()  # the teachers' weights
    if x is None:
        check_expand_factors(clients)
        moments = [client_input_moment(c) for c in clients]
        if not clients or any(m is None for m in moments):
            raise ConfigError("distillation without server inputs needs every client's first-layer K-FAC input "
                              "factor (structure kron)")
        moment = pooled_input_moment(moments, [c.n_data for c in clients])
        input_shape = synthetic_input_shape(cfg, clients)
        synthetic_key = checkpoints.fingerprint("data-free", cfg.to_json(), spec.to_json(), repr(pooling), weights,
                                                teachers, moment, list(input_shape))
        kept = checkpoints.saved_inputs(checkpoint, synthetic_key) if checkpoint is not None else None
        if kept is not None:
            log(f"distill: the {len(kept)} synthetic inputs of the interrupted run, from {checkpoint}")
            x, record = kept, dict(json.loads(checkpoints.metadata(checkpoint)["synthesis"]))
        else:
            log(f"synthesising {cfg.synth_size} inputs from the teachers and the clients' first-layer input moments")
            deeper = [] if cfg.moment_layers == "first" else layer_factors(clients)
            x, record = synthesise(spec, teachers, moment, input_shape, cfg, teacher, show_progress, deeper)
    w, out = teach(spec, teachers, x, cfg, pooling, weights, student=student, show_progress=show_progress,
                   teacher=teacher, log=log, checkpoint=checkpoint, synthetic_key=synthetic_key, synthesis=record,
                   max_memory=max_memory)
    if record:
        out.update(recipe="data-free", synthesis=record)
    out["teacher_sha256"] = digest
    return w, out
