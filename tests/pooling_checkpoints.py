"""Pooling checkpoints for tests, built with transformers' own classes: a sequence-classification copy of a
causal LM (its body's weights, a seeded random score head) and a tiny BERT encoder with a WordPiece tokenizer
built here."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def build_classifier(src: Path, out: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """`<Arch>ForSequenceClassification` (e.g. LlamaForSequenceClassification) from a causal LM checkpoint's
    weights plus a random score head."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if (out / "config.json").is_file():
        return out
    cfg = AutoConfig.from_pretrained(src)
    cfg.num_labels = num_labels
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(src, config=cfg, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():  # a head that spreads the scores (the default init leaves them all near 0)
        model.score.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


BERT_WORDS = ("the a an of to and in is was for on that with as by it at from this be are or his her their which "
              "capital city france paris brazil brasilia germany berlin river sea mountain music dog cat food "
              "weather rain sun snow cold hot what where who how why when apple banana red blue green").split()


def build_bert(out: Path, seed: int = 0) -> Path:
    """A tiny `BertModel` (2 layers) and a WordPiece tokenizer over a small vocabulary, saved as a checkpoint."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    if (out / "config.json").is_file():
        return out
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = sorted({c for w in BERT_WORDS for c in w})
    vocab = {t: i for i, t in enumerate(specials + list(BERT_WORDS) + letters + [f"##{c}" for c in letters] +
                                        list("?.,!"))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=128)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, architectures=["BertModel"])
    torch.manual_seed(seed)
    model = BertModel(cfg, add_pooling_layer=False).eval()
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out
