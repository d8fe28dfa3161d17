"""Load a checkpoint's tokenizer offline, and turn chat messages into prompt token ids."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the HF checkpoint in `model_dir`, never touching the network.

    The chat template is picked up from tokenizer_config.json or chat_template.jinja, whichever
    the checkpoint has. Only fast (tokenizer.json) tokenizers are supported: the gateway, the
    tokenizer service and the reference must all tokenize exactly alike.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {str(path)!r}: kvmesh needs a fast (tokenizers) tokenizer; "
            f"found {sorted(p.name for p in path.iterdir())}"
        )
    # The generic fast tokenizer, not AutoTokenizer: AutoTokenizer resolves the model's config classes,
    # which imports torch, and the gateway and tokenizer processes have no use for torch. Every fast
    # tokenizer is tokenizer.json plus tokenizer_config.json (specials, chat template), which this loads.
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, object]],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: Mapping[str, object] | None = None,
    chat_template: str | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Prompt ids for `messages` ({"role", "content"} dicts) through the checkpoint's chat template.

    The template writes any BOS itself; no special tokens are added on top. `chat_template` replaces the
    checkpoint's own for this call (transformers renders it in its sandboxed Jinja environment).
    add_special_tokens: the rendered text is tokenized with the tokenizer's special tokens added on top.
    """
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer of {tokenizer.name_or_path!r} has no chat template")
    # return_dict=False: transformers 5 defaults to a BatchEncoding, 4.x to a list.
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        tools=tools or None,
        tokenize=not add_special_tokens,
        return_dict=False,
        **({"chat_template": chat_template} if chat_template else {}),
        **dict(template_kwargs or {}),
    )
    if add_special_tokens:
        return [int(i) for i in tokenizer.encode(out, add_special_tokens=True)]
    if isinstance(out, Mapping):  # a BatchEncoding, should a version ignore return_dict
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], list):  # a batch of one
        (ids,) = ids
    return [int(i) for i in ids]
