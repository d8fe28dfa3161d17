"""The demo checkpoint, its tokenizer and chat template, as transformers sees them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from shared.cli import main
from shared.models.demo import build_demo_model
from shared.models.demo_tokenizer import BOS, EOS, IM_END, cached_byte_bpe, write_tokenizer_files
from shared.models.tokenizer import encode_chat, load_tokenizer

TEXTS = [
    "héllo wörld 你好 🙂",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n\n",
    "Ørsted’s “quotes” — π ≈ 3.14159; 5 × 7 = 35",
    "def f(x):\n    return x ** 2  # squared\n",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "héllo wörld 你好 🙂"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Again?"},
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "model"
    assert main(["demo-model", "--random", str(out)]) == 0
    return out


def test_cli_writes_a_sharded_checkpoint(demo_dir: Path) -> None:
    names = {p.name for p in demo_dir.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors.index.json"}
    assert expected | {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert len(list(demo_dir.glob("model-*-of-*.safetensors"))) >= 2


def test_same_seed_same_bytes_other_seed_other_weights(demo_dir: Path, tmp_path: Path) -> None:
    again = build_demo_model(tmp_path / "again", seed=0)
    for f in sorted(demo_dir.iterdir()):
        assert f.read_bytes() == (again / f.name).read_bytes(), f"{f.name} differs between two builds"
    other = build_demo_model(tmp_path / "other", seed=1)
    shard = sorted(demo_dir.glob("*.safetensors"))[0].name
    assert (other / shard).read_bytes() != (demo_dir / shard).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (demo_dir / "tokenizer.json").read_bytes()


def test_transformers_loads_and_generates(demo_dir: Path) -> None:
    tok = load_tokenizer(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir, local_files_only=True).eval()
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tok)
    assert not model.config.tie_word_embeddings
    gen = GenerationConfig.from_pretrained(demo_dir, local_files_only=True)
    assert gen.bos_token_id == tok.convert_tokens_to_ids(BOS)
    assert sorted(gen.eos_token_id) == sorted(tok.convert_tokens_to_ids([EOS, IM_END]))
    ids = encode_chat(tok, MESSAGES)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert out.shape == (1, len(ids) + 6)
    assert out[0, : len(ids)].tolist() == ids


@pytest.mark.parametrize("vocab_size", [512, 2048])
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_bytes_exactly(tmp_path: Path, vocab_size: int, text: str) -> None:
    write_tokenizer_files(cached_byte_bpe(vocab_size), tmp_path)
    tok = load_tokenizer(tmp_path)
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.decode(plain).encode() == text.encode()
    with_bos = tok.encode(text)
    assert with_bos == [tok.bos_token_id, *plain]
    assert tok.decode(with_bos, skip_special_tokens=True) == text


@pytest.mark.parametrize("in_jinja_file", [False, True])
def test_chat_template_inline_or_in_jinja_file(tmp_path: Path, in_jinja_file: bool) -> None:
    write_tokenizer_files(cached_byte_bpe(512), tmp_path, template_in_jinja_file=in_jinja_file)
    assert (tmp_path / "chat_template.jinja").exists() == in_jinja_file
    tok = load_tokenizer(tmp_path)
    ids = encode_chat(tok, MESSAGES)
    assert all(isinstance(i, int) for i in ids)
    text = tok.decode(ids)
    assert text.startswith(BOS + "<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert "<|im_start|>user\nhéllo wörld 你好 🙂<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the role markers are single special tokens, not spelled out in bytes
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == len(MESSAGES) + 1
    closed = tok.decode(encode_chat(tok, MESSAGES, add_generation_prompt=False))
    assert closed.endswith("Again?<|im_end|>\n")


def test_both_template_styles_give_the_same_ids(tmp_path: Path) -> None:
    ids = []
    for in_jinja_file in (False, True):
        write_tokenizer_files(cached_byte_bpe(512), tmp_path, template_in_jinja_file=in_jinja_file)
        ids.append(encode_chat(load_tokenizer(tmp_path), MESSAGES))
    assert ids[0] == ids[1]


def test_rewriting_inline_removes_a_stale_jinja_file(tmp_path: Path) -> None:
    write_tokenizer_files(cached_byte_bpe(512), tmp_path, chat_template="JINJA", template_in_jinja_file=True)
    write_tokenizer_files(cached_byte_bpe(512), tmp_path)
    assert not (tmp_path / "chat_template.jinja").exists()
    assert load_tokenizer(tmp_path).chat_template.startswith("{{- bos_token -}}")


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    write_tokenizer_files(cached_byte_bpe(512), tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(load_tokenizer(tmp_path), MESSAGES)


def test_missing_tokenizer_json_names_dir_and_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_cached_byte_bpe_trains_once() -> None:
    assert cached_byte_bpe(512) is cached_byte_bpe(512)
    assert cached_byte_bpe(512).get_vocab_size() == 512
