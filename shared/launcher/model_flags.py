"""`kvmesh up --model A --model B`: the mesh's models and each one's worker counts, from the flags.

`--model` and `--served-model-name` repeat in the same order (the i-th name is the i-th model's). A worker
count flag (`--prefill`, `--decode`, `--tokenizer`) is either one number, every model's count, or per model
`NAME=N,NAME=N`, where NAME is a model's served name, its `--model` value as given, or that path's last
part; a model it does not name keeps the default. One model: exactly the single-model flags of before.
"""
from __future__ import annotations

from pathlib import Path

from shared.launcher.process_spec import ModelServing

COUNT_ROLES = ("prefill", "decode", "tokenizer")


class ModelFlagError(ValueError):
    """A flag that names no model, a count that is not a number, names that do not pair up."""


def parse_counts(text: str | None, keys: list[set[str]], flag: str) -> list[int | None]:
    """Per model (in `keys` order: the names each model answers to): its count, or None where not given."""
    if text is None:
        return [None] * len(keys)
    text = text.strip()
    if text.lstrip("-").isdigit():
        return [int(text)] * len(keys)
    out: list[int | None] = [None] * len(keys)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.rpartition("=")
        if not eq or not value.strip().lstrip("-").isdigit():
            raise ModelFlagError(f"{flag} {text!r}: a number (every model) or NAME=N,NAME=N (per model)")
        hits = [i for i, k in enumerate(keys) if name.strip() in k]
        if len(hits) > 1:
            raise ModelFlagError(f"{flag}: {name.strip()!r} names {len(hits)} models; use their served names")
        if not hits:
            known = ", ".join(sorted(min(k, key=len) for k in keys))
            raise ModelFlagError(f"{flag}: no model named {name.strip()!r} (the models: {known})")
        for i in hits:
            out[i] = int(value)
    return out


def served_models(models: list[str], names: list[str], counts: dict[str, str | None],
                  defaults: dict[str, int]) -> tuple[ModelServing, ...]:
    """The mesh's models from the repeated flags; `counts`: role -> its flag's text (None: not given);
    `defaults`: role -> the count of a model the flag does not set."""
    if len(names) > len(models):
        raise ModelFlagError(f"{len(names)} --served-model-name for {len(models)} --model: give at most one name "
                             "per model, in the same order")
    given: list[str | None] = [*names, *[None] * (len(models) - len(names))]
    keys = []
    for model, name in zip(models, given):
        keys.append({model, Path(model).name, Path(model).resolve().name} | ({name} if name else set()))
    per_role = {role: parse_counts(counts.get(role), keys, f"--{role}") for role in COUNT_ROLES}
    out = []
    for i, (model, name) in enumerate(zip(models, given)):
        n = {role: per_role[role][i] for role in COUNT_ROLES}
        out.append(ModelServing(model, name, **{role: defaults[role] if n[role] is None else n[role]
                                                for role in COUNT_ROLES}))
    return tuple(out)
