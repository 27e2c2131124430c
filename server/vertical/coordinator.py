"""The label holder's side of vertical training, independent of how messages travel.

`VerticalCoordinator` aligns IDs with every site by PSI, checks the overlap, splits the label
holder's rows into training and held-out (test) rows, cuts validation rows from the training
rows (``val_fraction``; they never train, and choose the round kept: `protocol.selection`),
and runs split training: per step it asks every
site for the embeddings of a mini-batch of aligned rows, fills missing views, updates the
head and sends each site the gradient of its embedding slice (applied by the site before it
embeds the next batch). A `Transport` delivers messages: Flower's Grid in the ServerApp
(`server.vertical.app`), direct calls in tests and in-process comparisons.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.vertical import SiteOverlap, VerticalEvaluation, VerticalRound
from fedsplit.protocol.selection import BestRound, selection_metric
from fedsplit.protocol.tasks import infer_task, task_kind, task_names
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.protocol.vertical.psi import PsiSession
from fedsplit.protocol.vertical.saved import HeadMeta
from fedsplit.protocol.vertical.table import id_column_values, read_frame
from fedsplit.protocol.vertical.wire import Payload, pack_points, unpack_points
from fedsplit.server.vertical.head import FusionHead

log = logging.getLogger(__name__)

MEAN_ROW = -1  # "embed your training mean row" (the mean fill)
#: Share of the label holder's training rows cut off as validation rows (the round kept).
VAL_FRACTION = 0.2
MISSING = -1   # in `present`: the site does not hold this label row
WARN_OVERLAP = 0.3

Transport = Callable[[str, dict[int, Payload]], dict[int, Payload]]


class OverlapError(ConfigError):
    """A site shares too few patients with the label holder for a joint model."""


@dataclass
class LabelTable:
    """The label holder's IDs and encoded targets."""

    ids: list[str]
    y: np.ndarray  # int64 class indices, or float64 targets
    task: str
    classes: list[str] = field(default_factory=list)

    @property
    def num_outputs(self) -> int:
        """Logits per row (a task of classes), or 1 (values: regression)."""
        return len(self.classes) if task_kind(self.task).classes else 1


def encode_labels(ids: list[str], values: np.ndarray, task: str | None) -> LabelTable:
    """Encode a target column by its task kind (given, else inferred): classes become 0..K-1
    (sorted), values stay float; a kind split learning does not train is refused."""
    values = np.asarray(values)
    missing = [v is None or v != v for v in values]  # None or NaN
    if any(missing):
        raise ConfigError("The label file has rows without a target; drop them first. "
                          f"Received: {sum(missing)} missing")
    task = task or infer_task(values)
    kind = task_kind(task)
    if not kind.vertical:
        trained = ", ".join(name for name in task_names() if task_kind(name).vertical)
        raise ConfigError(f"Vertical split learning trains {trained}; not {task}. Choose one of "
                          f"those with --task. Received: {task!r}")
    if kind.classes:
        keys = [str(int(v)) if isinstance(v, float | np.floating) and float(v).is_integer() else str(v)
                for v in values]
        uniq = sorted(set(keys), key=lambda s: (0, float(s)) if _is_number(s) else (1, s))
        if len(uniq) < 2:
            raise ConfigError(f"Classification needs at least two classes in the target. Received: {uniq}")
        index = {c: i for i, c in enumerate(uniq)}
        return LabelTable(ids, np.array([index[k] for k in keys], dtype=np.int64), task, uniq)
    if values.dtype.kind not in "iuf":
        raise ConfigError(f"Regression needs a numeric target; use --task classification for labels. "
                          f"Received: dtype {values.dtype}")
    return LabelTable(ids, values.astype(np.float64), task)


def read_label_file(path: str, id_column: str, target: str, task: str | None) -> LabelTable:
    """The label holder's file: ID column and target column (CSV or Parquet)."""
    if not path:
        raise ConfigError("The coordinator holds the labels by default: give --labels FILE (run "
                          "config labels-path). Received: ''")
    frame = read_frame(path)
    ids = id_column_values(frame, id_column, path)
    if target not in frame.columns:
        raise ConfigError(f"{path} has no target column {target!r}; pass it with --target. Columns: "
                          f"{', '.join(map(str, frame.columns))}. Received: {target!r}")
    return encode_labels(ids, frame[target].to_numpy(), task)


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def split_rows(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) label-row indices: a seeded permutation of the label holder's rows."""
    perm = np.random.default_rng(seed).permutation(n)
    k = max(1, round(n * test_fraction))
    return np.sort(perm[k:]), np.sort(perm[:k])


def validation_cut(train_rows: np.ndarray, seed: int,
                   val_fraction: float = VAL_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(rows to train on, validation rows): a seeded ``val_fraction`` of ``train_rows``."""
    keep, val = split_rows(len(train_rows), val_fraction, seed + 7)
    return train_rows[keep], train_rows[val]


class VerticalCoordinator:
    """Runs alignment, preparation, split training and evaluation over ``sites`` (node ids).

    ``val_fraction`` > 0: that share of the training label rows becomes ``val_rows`` (scored
    like held-out rows, never trained on; `validation_cut`); 0: no validation rows.
    """

    def __init__(self, labels: LabelTable, params: FusionParams, sites: Sequence[int],
                 send: Transport, *, seed: int = 0, test_fraction: float = 0.2,
                 names: dict[int, str] | None = None, val_fraction: float = 0.0) -> None:
        if not sites:
            raise ConfigError("Vertical training needs at least one feature site. Received: 0 sites")
        self.labels = labels
        self.p = params
        self.sites = list(sites)
        self.send = send
        self.seed = seed
        self.test_fraction = test_fraction
        self.val_fraction = val_fraction
        self.val_rows = np.zeros(0, dtype=np.int64)
        self._auto_names = names is None
        self.names = names or {s: f"node-{s}" for s in self.sites}
        self.present = np.full((len(labels.ids), len(self.sites)), MISSING, dtype=np.int64)
        self.overlap: list[SiteOverlap] = []
        self.head: FusionHead | None = None
        self.step_count = 0
        self._pending: dict[int, Payload] = {}
        self._rng = np.random.default_rng(seed + 17)
        self._queue: list[int] = []
        self._neighbours: np.ndarray | None = None
        self.y_mean, self.y_std = 0.0, 1.0

    # --- 1. private ID alignment ------------------------------------------------------------
    def align(self) -> list[SiteOverlap]:
        """PSI with every site; fill `present`; refuse below the overlap floor."""
        sessions = {s: PsiSession(self.labels.ids) for s in self.sites}
        mine_single = {s: sessions[s].outgoing() for s in self.sites}
        replies = self.send("query.psi_start",
                            {s: Payload(arrays={"points": pack_points(mine_single[s])}) for s in self.sites})
        if self._auto_names:
            self.names = {s: str(replies[s].config.get("site", self.names[s])) for s in self.sites}
            self.sites.sort(key=lambda s: (self.names[s], s))
        finish: dict[int, Payload] = {}
        site_rows: dict[int, int] = {}
        for k, s in enumerate(self.sites):
            theirs_single = unpack_points(replies[s].arrays["points"])
            mine_double = unpack_points(replies[s].arrays["answer"])
            theirs_double = sessions[s].answer(theirs_single)
            alignment, _ = sessions[s].finish(mine_double, theirs_single, theirs_double)
            self.present[alignment.rows, k] = np.arange(alignment.size)
            site_rows[s] = int(replies[s].config["rows"])
            finish[s] = Payload(arrays={"mine": pack_points(theirs_double),
                                        "theirs": pack_points(mine_double)})
        done = self.send("query.psi_finish", finish)
        n = len(self.labels.ids)
        self.overlap = []
        low: list[tuple[str, float]] = []
        for k, s in enumerate(self.sites):
            shared = int((self.present[:, k] >= 0).sum())
            if int(done[s].config["shared"]) != shared:
                raise ConfigError(f"PSI disagreement with {self.names[s]}: the site found "
                                  f"{done[s].config['shared']} shared IDs, the label holder {shared}. "
                                  f"Re-run the alignment. Received: {done[s].config['shared']}")
            share = shared / n
            self.overlap.append(SiteOverlap(
                site=self.names[s], site_rows=site_rows[s], label_rows=n, shared=shared,
                share_of_labels=round(share, 4), share_of_site=round(shared / max(1, site_rows[s]), 4),
                status="ok" if share >= WARN_OVERLAP else "low"))
            if round(share, 4) < self.p.min_overlap:
                low.append((self.names[s], round(share, 4)))
            if share < WARN_OVERLAP:
                log.warning("%s shares only %.1f%% of the label holder's patients (< %d%%): "
                            "fills will lean on few linked patients", self.names[s], 100 * share,
                            int(100 * WARN_OVERLAP))
        if low:
            raise OverlapError(
                f"Too little overlap to fuse: {', '.join(site for site, _ in low)} share(s) fewer than "
                f"{self.p.min_overlap:.0%} of the label holder's patients. A joint model learns how a "
                f"site's columns relate to the others' only from patients seen by both; with so few "
                f"linked patients it has little to stand on and filling missing views becomes noise. "
                f"Train those sites separately, add linked patients, or lower min_overlap knowingly. "
                f"Received: {low}"
            )
        return self.overlap

    # --- 2. split and preparation -----------------------------------------------------------
    def prepare(self) -> None:
        """Split label rows, tell each site its training rows, build branches and the head."""
        n = len(self.labels.ids)
        train, test = split_rows(n, self.test_fraction, self.seed)
        seen = (self.present >= 0).any(axis=1)
        complete = (self.present >= 0).all(axis=1)
        if self.val_fraction > 0:
            train, val = validation_cut(train, self.seed, self.val_fraction)
            self.val_rows = val[seen[val]]
        self.train_rows = train[complete[train]] if self.p.fill == "drop" else train[seen[train]]
        self.test_rows = test[seen[test]]
        if len(self.train_rows) < 2:
            raise ConfigError(f"Only {len(self.train_rows)} linked training row(s) remain with fill "
                              f"{self.p.fill!r}; add linked patients or choose another fill. "
                              f"Received: {len(self.train_rows)}")
        if task_kind(self.labels.task).values:  # standardised targets
            y = self.labels.y[self.train_rows]
            self.y_mean, self.y_std = float(y.mean()), float(y.std()) or 1.0
        payloads = {}
        for k, s in enumerate(self.sites):
            pos = self.present[self.train_rows, k]
            payloads[s] = Payload(
                config={"embedding-dim": self.p.embedding_dim, "branch-hidden": self.p.branch_hidden,
                        "lr": self.p.lr, "seed": self.seed + 1 + k},
                arrays={"train-positions": np.sort(pos[pos >= 0]).astype(np.int64)})
        replies = self.send("query.prepare", payloads)
        self.input_widths = {self.names[s]: int(replies[s].config["input-width"]) for s in self.sites}
        self.head = FusionHead([self.p.embedding_dim] * len(self.sites), self.labels.num_outputs,
                               self.labels.task, self.p.head_hidden, self.p.lr, self.seed)

    def _target(self, rows: np.ndarray) -> np.ndarray:
        y = self.labels.y[rows]
        return y if task_kind(self.labels.task).classes else (y - self.y_mean) / self.y_std

    # --- 3. split training ------------------------------------------------------------------
    def _next_batch(self) -> np.ndarray:
        b = min(self.p.batch_size, len(self.train_rows))
        if len(self._queue) < b:
            self._queue += self._rng.permutation(self.train_rows).tolist()
        batch, self._queue = self._queue[:b], self._queue[b:]
        return np.asarray(batch, dtype=np.int64)

    def _sources(self, rows: np.ndarray, k: int, neighbours: np.ndarray | None) -> np.ndarray:
        """Per row, the site-k position to embed: own row, borrowed row, MEAN_ROW, or -2 (zero)."""
        pos = self.present[rows, k].copy()
        miss = pos < 0
        if not miss.any():
            return pos
        if self.p.fill == "nearest" and neighbours is not None:
            pos[miss] = neighbours[rows[miss], k]
        elif self.p.fill in ("mean", "drop"):  # drop only scores incomplete held-out rows this way
            pos[miss] = MEAN_ROW
        else:
            pos[miss] = -2
        return pos

    def _gather(self, rows: np.ndarray, neighbours: np.ndarray | None, message_type: str,
                extra: dict[int, dict[str, np.ndarray]] | None = None) -> tuple[list[np.ndarray],
                                                                                dict[int, np.ndarray]]:
        """Ask every site for the embeddings ``rows`` need; zero-fill what no site provides."""
        sources = {s: self._sources(rows, k, neighbours) for k, s in enumerate(self.sites)}
        payloads = {}
        for s in self.sites:
            arrays = dict((extra or {}).get(s, {}))
            arrays["positions"] = sources[s][sources[s] >= MEAN_ROW].astype(np.int64)
            payloads[s] = Payload(arrays=arrays)
        replies = self.send(message_type, payloads)
        embeddings = []
        for s in self.sites:
            e = np.zeros((len(rows), self.p.embedding_dim), dtype=np.float32)
            got = replies[s].arrays["embeddings"]
            used = sources[s] >= MEAN_ROW
            if got.shape != (int(used.sum()), self.p.embedding_dim):
                raise ConfigError(f"{self.names[s]} sent embeddings of shape {got.shape}; expected "
                                  f"({int(used.sum())}, {self.p.embedding_dim}). Received: {got.shape}")
            e[used] = got
            embeddings.append(e)
        return embeddings, sources

    def train_round(self) -> float:
        """``steps_per_round`` split-training steps; returns the mean training loss."""
        assert self.head is not None, "prepare() first"
        neighbours = self.neighbours() if self.p.fill == "nearest" else None
        losses = []
        for _ in range(self.p.steps_per_round):
            rows = self._next_batch()
            extra = {s: p.arrays for s, p in self._pending.items()}
            embeddings, sources = self._gather(rows, neighbours, "train.step", extra)
            loss, grads = self.head.step(embeddings, self._target(rows))
            self._pending = {}
            for k, s in enumerate(self.sites):
                used = sources[s] >= MEAN_ROW
                if used.any():
                    self._pending[s] = Payload(arrays={
                        "grad-positions": sources[s][used].astype(np.int64),
                        "gradients": grads[k][used].astype(np.float32)})
            losses.append(loss)
            self.step_count += 1
        self.flush()
        return float(np.mean(losses))

    def flush(self) -> None:
        """Deliver gradients still owed to sites (so their branches are up to date)."""
        if self._pending:
            self.send("train.step", {s: Payload(arrays=dict(p.arrays)) for s, p in self._pending.items()})
            self._pending = {}

    # --- nearest-neighbour borrowing ---------------------------------------------------------
    def _embed_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        """Own-row embeddings (NaN where a site lacks the row)."""
        embeddings, sources = self._gather(rows, None, "query.embed")
        out = []
        for e, s in zip(embeddings, self.sites, strict=True):
            e = e.astype(np.float64)
            e[sources[s] < 0] = np.nan
            out.append(e)
        return out

    def neighbours(self, targets: np.ndarray | None = None) -> np.ndarray:
        """For every label row (or ``targets``) and site: the site position to borrow, or MEAN_ROW.

        The donor is the training patient closest to the row on the views the row has (summed
        squared distance between branch embeddings), among patients that have those views and
        the missing one; with no such patient, the site's mean row.
        """
        pool = self.train_rows
        rows = pool if targets is None else np.union1d(pool, targets)
        emb = self._embed_rows(rows)
        where = {r: i for i, r in enumerate(rows)}
        pool_idx = np.array([where[r] for r in pool])
        out = np.full(self.present.shape, MEAN_ROW, dtype=np.int64)
        have = self.present[rows] >= 0
        for k in range(len(self.sites)):
            missing = np.flatnonzero(~have[:, k])
            patterns = {tuple(have[i]) for i in missing}
            for pattern in patterns:
                views = [j for j, h in enumerate(pattern) if h]
                members = np.array([i for i in missing if tuple(have[i]) == pattern])
                donors = pool_idx[have[pool_idx][:, [*views, k]].all(axis=1)]
                if not views or len(donors) == 0:
                    continue
                for start in range(0, len(members), 512):
                    chunk = members[start:start + 512]
                    dist = np.zeros((len(chunk), len(donors)))
                    for j in views:
                        a, b = emb[j][chunk], emb[j][donors]
                        dist += (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
                    best = donors[np.argmin(dist, axis=1)]
                    out[rows[chunk], k] = self.present[rows[best], k]
        self._neighbours = out
        return out

    # --- 4. evaluation ------------------------------------------------------------------------
    def evaluate(self, rows: np.ndarray | None = None) -> VerticalEvaluation:
        """Score the fused model on held-out rows (all, and those every site holds)."""
        assert self.head is not None, "prepare() first"
        self.flush()
        rows = self.test_rows if rows is None else rows
        neighbours = self.neighbours(rows) if self.p.fill == "nearest" else None
        embeddings, _ = self._gather(rows, neighbours, "query.embed")
        out = self.head.outputs(embeddings)
        complete = (self.present[rows] >= 0).all(axis=1)
        result = VerticalEvaluation(num_examples=len(rows), metrics=self._metrics(out, rows),
                                    complete_rows=int(complete.sum()))
        if complete.any() and not complete.all():
            result.metrics_complete_rows = self._metrics(out[complete], rows[complete])
        return result

    def train_and_keep(self, rounds: int, keep: str = "best-val", *,
                       on_round: Callable[[VerticalRound, BestRound], None] | None = None,
                       ) -> tuple[BestRound, list[VerticalRound]]:
        """Train ``rounds`` rounds; after each, score the model on the validation rows and
        on the held-out rows, and offer the validation score to the selection rule.

        ``keep``: ``best-val`` (the best validation round by the task metric, ties to the
        later: `protocol.selection`) or ``last``; without validation rows the last round is
        kept. Per round a `VerticalRound`: ``round``, ``train_loss``, ``steps``, ``seconds``,
        the held-out evaluation (``metrics``, ``num_examples``, ...), ``val_metrics`` and
        ``val_examples``.
        ``on_round(entry, rule)`` runs after each round (``rule.round`` is the kept one).
        """
        if not len(self.val_rows) and keep != "last":
            log.warning("No validation rows (val_fraction=%s): keeping the last round",
                        self.val_fraction)
            keep = "last"
        metric = selection_metric(self.labels.task)
        rule = BestRound(keep)
        entries = []
        for rnd in range(1, rounds + 1):
            t = time.monotonic()
            loss = self.train_round()
            val = self.evaluate(self.val_rows) if len(self.val_rows) else None
            test = self.evaluate()
            score = val.metrics[metric] if val else None
            rule.offer(score if isinstance(score, float | int) else None)
            entry = VerticalRound.of(rnd, train_loss=loss, steps=self.step_count,
                                     seconds=round(time.monotonic() - t, 3), test=test, val=val,
                                     val_examples=len(self.val_rows))
            entries.append(entry)
            if on_round is not None:
                on_round(entry, rule)
        return rule, entries

    def _metrics(self, out: np.ndarray, rows: np.ndarray) -> dict[str, float]:
        """The task kind's metrics (`protocol.tasks`: accuracy; r2 and rmse in target units)."""
        kind = task_kind(self.labels.task)
        pred = out.argmax(1) if kind.classes else out[:, 0] * self.y_std + self.y_mean
        return kind.score(self.labels.y[rows], pred)

    def save_sites(self, tag: str, slot: str = "") -> list[str]:
        """Ask every site to save its branch and preprocessing where it keeps its data
        (``slot`` '': the kept round's model; ``last``: the last round's, in ``last/``)."""
        self.flush()
        config = {"tag": tag, **({"slot": slot} if slot else {})}
        replies = self.send("query.save", {s: Payload(config=dict(config)) for s in self.sites})
        return [str(replies[s].config["saved"]) for s in self.sites]

    def head_meta(self) -> HeadMeta:
        """What `fedsplit vertical predict` needs besides the head's weights."""
        return HeadMeta(task=self.labels.task, classes=self.labels.classes, y_mean=self.y_mean,
                        y_std=self.y_std, sites=[self.names[s] for s in self.sites],
                        params=self.p, num_outputs=self.labels.num_outputs, seed=self.seed)
