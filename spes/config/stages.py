"""The sections of the pipeline's other stages: tokenize, data order, the initial model, the dense model, the
evaluation and the comparison."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from spes.config.choices import CORPUS_FORMATS, DATA_ORDERS, EXPORT_ARCHS, INIT_MODES, ROUND_WINDOWS, need
from spes.config.training import OptimConfig


@dataclass
class TokenizeConfig:
    """Corpus -> tokenizer -> token shards (spes/data/corpus.py, spes/data/tokenization.py), streamed."""

    corpus: Optional[str] = None
    """Corpus files: a path, glob or fsspec URL (s3://...), several separated by commas. None (and no
    `dataset`) = the Python stdlib's source."""
    corpus_format: str = "auto"
    """'auto' (by extension), 'text' (a file is a document), 'json' (jsonl, or a JSON array) or 'parquet'."""
    text_field: str = "text"
    """The field (json) or column (parquet, hub datasets) that holds a document's text."""
    dataset: Optional[str] = None
    """A Hugging Face hub dataset id, instead of `corpus` (read with `datasets.load_dataset`)."""
    dataset_name: Optional[str] = None
    """The hub dataset's configuration name, if it has several."""
    dataset_split: str = "train"
    streaming: bool = True
    """Stream the hub dataset (nothing downloaded in full, nothing cached in Arrow files)."""
    skip_bad_files: bool = False
    """Skip (and count) corpus files that cannot be read or decoded, instead of stopping with their name."""
    max_files: int = 400
    """Cap on corpus files when the default (stdlib) corpus is used."""
    tokenizer: Optional[str] = None
    """A pretrained tokenizer (tokenizer.json file, folder or hub id); None = train a byte-level BPE."""
    eos_token: Optional[str] = None
    """The token that ends every document; None = the tokenizer's own EOS or a known name (<|endoftext|>, </s>...)."""
    bpe_sample_docs: int = 20000
    """Documents (the first ones) the BPE is trained on: a bounded sample, not the whole corpus."""
    shard_tokens: int = 1 << 28
    """Tokens per shard file (2^28 = 512 MiB of uint16)."""
    val_fraction: float = 0.13
    """Share of documents held out, by a keyed hash of each document (stable under streaming and re-runs);
    on the embedded default enough (>= 40 documents, >= 200k tokens) to tell variants 0.5% apart."""
    seed: int = 0
    """Key of the held-out hash."""

    def validate(self) -> None:
        t = self
        need(t.corpus_format in CORPUS_FORMATS,
             f"tokenize.corpus_format must be {'|'.join(CORPUS_FORMATS)}, got {t.corpus_format!r}")
        need(not (t.corpus and t.dataset), "tokenize.corpus and tokenize.dataset are exclusive: name one source")
        need(bool(t.text_field), "tokenize.text_field must not be empty")
        need(0.0 < t.val_fraction < 0.5, "tokenize.val_fraction must be in (0, 0.5)")
        need(t.max_files >= 1, f"tokenize.max_files must be >= 1, got {t.max_files}")
        need(t.bpe_sample_docs >= 1, f"tokenize.bpe_sample_docs must be >= 1, got {t.bpe_sample_docs}")
        need(t.shard_tokens >= 1024, f"tokenize.shard_tokens must be >= 1024, got {t.shard_tokens}")


@dataclass
class DataConfig:
    order: str = "epoch"
    """How nodes read training windows (spes/data/order.py): 'epoch' = each epoch a permutation of the
    non-overlapping windows, split disjointly across nodes; 'random_windows' = uniformly random windows with
    replacement per node (what the reference does)."""

    def validate(self) -> None:
        need(self.order in DATA_ORDERS, f"data.order must be one of {'|'.join(DATA_ORDERS)}, got {self.order!r}")


@dataclass
class InitConfig:
    mode: str = "upcycle"
    """'scratch' = random MoE init; 'upcycle' = each expert a copy of a dense MLP."""
    dense_checkpoint: Optional[str] = None
    """HF dense checkpoint (path or hub id) to upcycle; None = the `dense` stage's model."""
    noise_std: float = 0.0
    noise_fraction: float = 0.5
    """Fraction of each expert's weights that receive Gaussian noise."""
    router_init_std: float = 0.02
    """Router weights ~ N(0, std) at init (upcycled or scratch); 0 = zeros, the reference's default."""
    seed: int = 0

    def validate(self) -> None:
        need(self.mode in INIT_MODES, f"init.mode must be {'|'.join(INIT_MODES)}, got {self.mode!r}")
        need(0.0 <= self.noise_fraction <= 1.0, "init.noise_fraction must be in [0, 1]")
        need(self.noise_std >= 0 and self.router_init_std >= 0, "init.noise_std and init.router_init_std must be >= 0")


@dataclass
class DenseConfig:
    """Short dense pre-training whose HF checkpoint the `upcycle` stage consumes."""

    steps: int = 150
    batch_size: int = 8
    seq_len: int = 128
    seed: int = 0
    export_arch: str = "auto"
    """HF architecture to write: 'auto' (Qwen3 if qk_norm='head' else Llama), 'qwen3', 'llama'."""
    optim: OptimConfig = field(default_factory=OptimConfig)

    def validate(self) -> None:
        need(self.steps >= 1, f"dense.steps must be >= 1, got {self.steps}")
        need(self.batch_size >= 1, f"dense.batch_size must be >= 1, got {self.batch_size}")
        self.optim.validate("dense.optim")
        need(self.export_arch in EXPORT_ARCHS,
             f"dense.export_arch must be {'|'.join(EXPORT_ARCHS)}, got {self.export_arch!r}")


@dataclass
class EvalConfig:
    batches: Optional[int] = None
    """Batches of the held-out split the `evaluate` stage scores; None = all of it (the default)."""
    batch_size: int = 8
    seq_len: int = 128
    every_rounds: int = 1
    """Held-out loss of the committed global every this many rounds (0 = never), on the first
    `round_batches` batches: shown in the round's Prefect table and stored in its record."""
    round_batches: int = 8
    """8 batches of 8 windows: about a twentieth of a round of the embedded default on 2 CPU cores (16 cost a
    tenth); the studies pin 16, the value their committed per-round curves were scored with."""
    round_windows: str = "spread"
    """Which windows the per-round held-out loss uses: 'spread' = evenly spaced over the whole split (each
    document about its share: an estimate of the whole split's loss), 'first' = the first ones (before
    2026-12: 16 batches of the default split came from 5 of its 46 documents)."""
    max_windows_per_document: Optional[int] = None
    """At most this many held-out windows of one document are scored (a longer document's evenly spaced over
    it), so that no document holds more than its share: None = every window (the scores of runs before
    2026-12-06; on the embedded default the three longest of 48 documents hold 38% of the windows)."""
    lm_eval_tasks: list[str] = field(default_factory=list)
    """lm-eval task names (or names defined in `lm_eval_include`); empty = skip."""
    lm_eval_include: Optional[str] = None
    lm_eval_limit: Optional[int] = None

    def validate(self) -> None:
        e = self
        need((e.batches is None or e.batches >= 1) and e.batch_size >= 1,
             "eval.batches (or null) and eval.batch_size must be >= 1")
        need(e.every_rounds >= 0 and e.round_batches >= 1, "eval.every_rounds must be >= 0 and eval.round_batches >= 1")
        need(e.max_windows_per_document is None or e.max_windows_per_document >= 1,
             f"eval.max_windows_per_document must be >= 1 or null, got {e.max_windows_per_document}")
        need(e.round_windows in ROUND_WINDOWS,
             f"eval.round_windows must be {'|'.join(ROUND_WINDOWS)}, got {e.round_windows!r}")


@dataclass
class CompareConfig:
    """The comparison pipeline (compare/dvc.yaml): every variant x seed x lr x budget as its own run."""

    variants: dict[str, list[str]] = field(default_factory=dict)
    """Name -> `key=value` overrides (params.yaml lists spes, spes-no-merge, diloco, fedavg, centralized,
    spes-4nodes, spes-int8). All variants train on the same tokens from the same initial model (the per-node
    batch shrinks where nodes are added: 'spes-4nodes' halves it). Empty here: a dict default would be
    merged into, not replaced by, the one in params.yaml."""
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    """train.seed of each repeat (data order and node randomness; the initial model stays the same)."""
    lrs: list[float] = field(default_factory=lambda: [0.002])
    """The learning-rate sweep every variant gets (the best of each is reported, the sweep is shown)."""
    budgets: list[int] = field(default_factory=lambda: [1])
    """Token budgets as multiples of sync.rounds (e.g. [1, 4]): does the gap shrink with tokens?"""
    baseline: str = "centralized"
    """The variant the others are divided by (ratio_to_centralized)."""
    pairs: dict[str, str] = field(default_factory=dict)
    """Variant -> the variant it is set against (params.yaml: spes -> spes-no-merge), or several, comma-separated
    ("scratch-experts-8, scratch-experts-4"; `pair_list`): the report gives each
    pair's difference, paired by seed, lr and held-out window, its document-clustered and seed standard errors,
    and whether it is beyond both. A file that writes compare.variants replaces these too (they name variants)."""
    node_memory: Optional[str] = None
    """A memory budget per node for the report (weights + gradients + Adam, by the planner): a variant's name
    (what one of its nodes needs) or a size such as 40MiB. The report marks each variant within it or over it:
    the paper's question, which method gives the best model with the memory each machine has."""
    target_loss: Optional[float] = None
    """The per-round held-out loss whose tokens-to-reach the report gives (a second measure beside the final
    loss); None = the highest of the runs' last per-round losses at each budget, which every run reaches."""

    def pair_list(self) -> list[tuple[str, str]]:
        """compare.pairs as (variant, reference) pairs, in order: one per reference a value names."""
        return [(variant, ref.strip()) for variant, refs in self.pairs.items() for ref in refs.split(",")]

    def validate(self) -> None:
        need(self.target_loss is None or self.target_loss > 0,
             f"compare.target_loss must be > 0 or null, got {self.target_loss}")
