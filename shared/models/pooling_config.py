"""What a pooling model computes: vLLM's `--runner pooling`, `--convert embed|classify` and `--pooler-config`.

Torch-free: the gateway reads it to know which endpoints the served model answers, the engine worker to
build its pooler. The task follows the checkpoint's architecture unless `--convert` says otherwise:
`*ForSequenceClassification` classifies, anything else (a bare encoder such as `BertModel`, or a causal LM
asked to) embeds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

RUNNERS = ("generate", "pooling")
CONVERTS = ("auto", "embed", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForMaskedLM", "XLMRobertaModel", "RobertaModel"})


class PoolingConfigError(ValueError):
    pass


@dataclass(frozen=True)
class PoolerConfig:
    """How hidden states become one vector a request. None fields take the task's default (resolved())."""

    pooling_type: str | None = None  # LAST | MEAN | CLS
    normalize: bool | None = None  # embed: L2-normalize the vector
    activation: bool | None = None  # classify: sigmoid (one label) or softmax (several) over the logits

    @classmethod
    def parse(cls, text: str | None) -> PoolerConfig:
        """vLLM's --pooler-config JSON: {"pooling_type": "MEAN", "normalize": false, "softmax": true, ...}."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PoolingConfigError(f"--pooler-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise PoolingConfigError("--pooler-config must be a JSON object")
        known = {"pooling_type", "normalize", "activation", "softmax", "use_activation"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise PoolingConfigError(f"--pooler-config: unknown key(s) {', '.join(unknown)} (known: "
                                     f"{', '.join(sorted(known))})")
        ptype = raw.get("pooling_type")
        if ptype is not None:
            if not isinstance(ptype, str) or ptype.upper() not in POOLING_TYPES:
                raise PoolingConfigError(f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}")
            ptype = ptype.upper()
        flags = {}
        for key in ("normalize", "activation", "softmax", "use_activation"):
            if key in raw and not isinstance(raw[key], bool):
                raise PoolingConfigError(f"--pooler-config: {key} must be true or false")
            flags[key] = raw.get(key)
        # vLLM spells the classifier's activation three ways over its versions.
        act = next((flags[k] for k in ("activation", "use_activation", "softmax") if flags[k] is not None), None)
        return cls(pooling_type=ptype, normalize=flags["normalize"], activation=act)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in (("pooling_type", self.pooling_type), ("normalize", self.normalize),
                                             ("activation", self.activation)) if v is not None})


@dataclass(frozen=True)
class PoolingSpec:
    """The served pooling model: its task, architecture, labels and the resolved pooler."""

    task: str  # "embed" | "classify"
    architecture: str
    encoder: bool  # bidirectional encoder (BERT family) rather than a causal decoder
    num_labels: int
    pooler: PoolerConfig
    # vLLM's use_sep_token (use_pad_token in older versions): a cross-encoder pair goes through the tokenizer as a
    # text pair; False: query + document as one text ("LLM as reranker" checkpoints say so in config.json).
    pair_as_text_pair: bool = True
    id2label: tuple[str, ...] = ()
    matryoshka_dimensions: tuple[int, ...] | None = None
    hidden_size: int = 0
    vocab_size: int = 0
    max_position_embeddings: int = 0

    @property
    def output_size(self) -> int:
        return self.num_labels if self.task == "classify" else self.hidden_size


def _default_pooling_type(encoder: bool, model_dir: Path) -> str:
    if not encoder:
        return "LAST"  # a causal model has seen the whole input only at its last token
    # A sentence-transformers checkpoint says how it pools in 1_Pooling/config.json.
    st = model_dir / "1_Pooling" / "config.json"
    if st.is_file():
        try:
            raw = json.loads(st.read_text())
        except (OSError, json.JSONDecodeError):
            raw = {}
        if raw.get("pooling_mode_mean_tokens"):
            return "MEAN"
        if raw.get("pooling_mode_lasttoken"):
            return "LAST"
    return "CLS"


def pooling_spec(model_dir: str | Path, convert: str = "auto", pooler: PoolerConfig | None = None) -> PoolingSpec:
    """The pooling model served from `model_dir`; PoolingConfigError when it cannot serve as asked."""
    model_dir = Path(model_dir)
    if convert not in CONVERTS:
        raise PoolingConfigError(f"--convert must be one of {', '.join(CONVERTS)}")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PoolingConfigError(f"{model_dir}: no readable config.json ({e})") from None
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    encoder = arch in ENCODER_ARCHITECTURES or cfg.get("model_type") in ("bert", "roberta", "xlm-roberta")
    classifier = arch.endswith("ForSequenceClassification")
    task = convert if convert != "auto" else ("classify" if classifier else "embed")
    if task == "classify" and encoder:
        raise PoolingConfigError(f"{arch}: an encoder's classification head is not supported (encoders embed)")
    if task == "classify" and not classifier:
        raise PoolingConfigError(f"{arch} has no classification head: --convert classify needs a "
                                 "*ForSequenceClassification checkpoint")
    labels = cfg.get("id2label") or {}
    num_labels = int(cfg.get("num_labels") or len(labels) or 1) if classifier else 0
    id2label = tuple(str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    pooler = pooler or PoolerConfig()
    resolved = replace(
        pooler,
        pooling_type=pooler.pooling_type or _default_pooling_type(encoder, model_dir),
        normalize=(task == "embed") if pooler.normalize is None else pooler.normalize,
        activation=(task == "classify") if pooler.activation is None else pooler.activation)
    dims = cfg.get("matryoshka_dimensions")
    pair = cfg.get("use_sep_token", cfg.get("use_pad_token", True))
    return PoolingSpec(task=task, architecture=arch, encoder=bool(encoder), num_labels=num_labels, pooler=resolved,
                       pair_as_text_pair=bool(pair), id2label=id2label,
                       matryoshka_dimensions=tuple(int(d) for d in dims) if dims else
                       (() if cfg.get("is_matryoshka") else None),
                       hidden_size=int(cfg.get("hidden_size", 0)), vocab_size=int(cfg.get("vocab_size", 0)),
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 0)))
