"""Finding out how (and whether) a server can be made to ignore EOS."""
from __future__ import annotations

from dataclasses import dataclass, replace

import httpx

from .payload import Endpoint, EosMode, build_body


@dataclass(frozen=True)
class EosProbe:
    mode: EosMode
    note: str


async def probe_eos_mode(client: httpx.AsyncClient, ep: Endpoint) -> EosProbe:
    """Try `ignore_eos`, then transformers' `generation_config`, with one tiny non-streamed
    request each; the first one the server accepts wins. A server that rejects both, or is
    down, runs with OFF and the report says so (short outputs are then counted).
    The probe prompt is plain text so that a server refusing token ids is not misread."""
    notes = []
    for mode in (EosMode.IGNORE_EOS, EosMode.HF_GENERATION_CONFIG):
        trial = replace(ep, eos_mode=mode, stream=False)
        try:
            resp = await client.post(trial.url, json=build_body(trial, "hello", [], 2), headers=trial.headers())
        except httpx.HTTPError as e:
            return EosProbe(EosMode.OFF, f"probe could not reach the server ({type(e).__name__}); EOS not forced")
        if resp.status_code == 200:
            return EosProbe(mode, "; ".join(notes + [f"server accepted {mode.value}"]))
        notes.append(f"{mode.value} rejected (HTTP {resp.status_code})")
    return EosProbe(EosMode.OFF, "; ".join(notes) + "; EOS not forced, outputs may be shorter than requested")
