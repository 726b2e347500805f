"""A variant's recipe as a `llama-quantize` command line: the same mix made by llama.cpp's quantizer.

llama-quantize takes `--tensor-type PATTERN=TYPE`, PATTERN a regular
expression searched in each tensor's name, the first pattern that matches
deciding. `blk.N.ffn_gate_exps` matches exactly layer N's tensor of that role
(the dots match themselves, and no other tensor name contains the string), so
every tensor a recipe chose is named once with its format (the attention
patterns also match that layer's 1-D q/k norms, which llama-quantize never
quantizes); the shared expert's down projection, where the recipe does not
choose it, takes the variant's `shexp_down`, as our assembly requantizes it;
`--pure` keeps every other tensor at the base type, the source's own type of
its other matrices (token embedding and output keep theirs), so the rest of
the model stays at the source's precision as in our variant.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gguf import GGMLQuantizationType

from moeheal.pipeline.gguf.model import GGUFModel
from moeheal.pipeline.model.roles import ROUTED_TENSOR

UNQUANTIZED = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def base_type(source: GGUFModel) -> GGMLQuantizationType:
    """The type most of the source's matrices outside the routed experts, token embedding and output have."""
    counts = Counter(ggml_type for name, (ggml_type, _, _) in source.tensor_sizes().items()
                     if len(source.shape(name)) >= 2 and not ROUTED_TENSOR.match(name)
                     and not name.startswith(("token_embd.", "output.")))
    return counts.most_common(1)[0][0] if counts else GGMLQuantizationType.Q8_0


def llama_quantize_command(formats: dict[str, str], source: GGUFModel, out: Path, shexp_down: str | None,
                           imatrix: Path | None, binary: str = "llama-quantize") -> list[str]:
    """argv of llama-quantize writing `out` from `source` with each tensor of `formats` in its format
    ({"blk.N.ffn_gate_exps.weight": "q2_k", ...}) and, unless `formats` names it, `shexp_down` for
    the shared down projection."""
    sizes = source.tensor_sizes()
    argv = [binary, "--pure"]
    if any(t not in UNQUANTIZED for t, _, _ in sizes.values()):
        argv.append("--allow-requantize")
    if imatrix is not None:
        argv += ["--imatrix", str(imatrix)]
    for flag, name in (("--token-embedding-type", "token_embd.weight"), ("--output-tensor-type", "output.weight")):
        if name in sizes:
            argv += [flag, sizes[name][0].name.lower()]
    for tensor, fmt in formats.items():
        argv += ["--tensor-type", f"{tensor.removesuffix('.weight')}={fmt}"]
    if shexp_down is not None and source.has_shared_expert and not any("ffn_down_shexp" in t for t in formats):
        argv += ["--tensor-type", f"ffn_down_shexp={shexp_down}"]
    return argv + [str(source.path), str(out), base_type(source).name]
