"""KernelBench's static rules for a Triton or CUDA ``ModelNew`` file, as its ``kernel_static_checker.py``
matches them (regular expressions on each line cut at its first ``#`` and then its first ``//``, strings
included): the union of its past and present strict patterns, plus layers and ``functional`` through
aliases, so a file that passes here passes KernelBench. Forbidding rules also match with only ``#`` cut."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    name: str
    category: str  # KernelBench's check name
    pattern: re.Pattern
    required: bool = False  # True: the file must contain a match; False: a match is a violation
    backend: str | None = None  # a requirement of this backend only ("triton" or "cuda"); None: every file


@dataclass(frozen=True)
class Violation:
    rule: str
    category: str
    line: int  # 1-based line of the match; 0 for a missing requirement
    text: str  # the matched text (or the requirement's pattern)

    def __str__(self) -> str:
        return (f"line {self.line}: {self.category}/{self.rule}: {self.text!r}" if self.line
                else f"file: {self.category}/{self.rule}: missing {self.text!r}")


_r = re.compile
# Names torch.nn may be followed by in a file: containers, Parameter and init.
_NN_ALLOWED = r"(?:Module|parameter|Parameter|ParameterList|ParameterDict|ModuleList|ModuleDict|init)\b"

# High-level torch ops KernelBench forbids under strict settings, followed by "(", whitespace or the end.
_TORCH_OPS = (
    ["mm", "bmm", "matmul", "einsum", "conv", "linear", "logsumexp", "clamp", "dropout"]
    + [f"conv{d}d" for d in (1, 2, 3)] + [f"conv_transpose{d}d" for d in (1, 2, 3)]
    + [f"{kind}_pool{d}d" for kind in ("avg", "max", "adaptive_avg", "adaptive_max") for d in (1, 2, 3)]
    + ["relu", "hardtanh", "elu", "selu", "leaky_relu", "gelu", "softsign", "softplus", "softmax",
       "log_softmax", "tanh", "sigmoid", "hardsigmoid", "silu", "mish"]
    + ["batch_norm", "group_norm", "layer_norm", "instance_norm", "rms_norm", "normalize"]
    + ["cross_entropy", "kl_div", "mse_loss", "huber_loss", "triplet_margin_loss", "cosine_similarity"]
)
_F_OPS = "conv|linear|relu|gelu|softmax|batch_norm|layer_norm|dropout|max_pool|avg_pool"

RULES: tuple[Rule, ...] = (
    Rule("try", "code_bypass", _r(r"\btry\s*:")),
    Rule("bare-except", "code_bypass", _r(r"\bexcept\s*:")),
    Rule("except", "code_bypass", _r(r"\bexcept\s+\w+")),
    Rule("pass-word", "code_bypass", _r(r"\bpass\b")),
    Rule("timing-patch", "timing_event_patch",
         _r(r"torch\.cuda\.Event\.(?:record|elapsed_time)\s*=|torch\.cuda\.synchronize\s*=|torch\.cuda\.Event\s*="
            r"|time\.perf_counter\s*=|time\.time\s*=")),
    Rule("threading", "thread_injection", _r(r"threading\.(?:Thread|Event|Lock|RLock|Condition|Semaphore|Barrier|"
                                             r"Timer)|\bThread\s*\(|import\s+threading|from\s+threading\s+import")),
    Rule("multiprocessing", "thread_injection",
         _r(r"multiprocessing\.(?:Process|Pool|Manager|Queue|Pipe)|import\s+multiprocessing|from\s+multiprocessing")),
    Rule("executors", "thread_injection", _r(r"concurrent\.futures|ThreadPoolExecutor|ProcessPoolExecutor")),
    Rule("lazy-tensor", "lazy_eval", _r(r"_make_subclass|class\s+\w+.*\(torch\.Tensor\)|class\s+\w+.*\(Tensor\)"
                                        r"|torch\.Tensor\.__new__|\._view\(|\.view_as\(")),
    Rule("triton-jit", "triton_impl", _r(r"@triton\.(?:jit|autotune)"), required=True, backend="triton"),
    Rule("tl-op", "triton_impl", _r(r"\btl\.\w+"), required=True, backend="triton"),
    Rule("tl-memory-op", "triton_impl", _r(r"tl\.(?:load|store)\s*\("), required=True, backend="triton"),
    Rule("tl-indexing", "triton_impl",
         _r(r"tl\.(?:program_id|num_programs|arange|cdiv)\s*\(|tl\.constexpr"), required=True, backend="triton"),
    Rule("cuda-global", "cuda_impl", _r(r"__global__"), required=True, backend="cuda"),
    Rule("cuda-load-inline", "cuda_impl", _r(r"\bload_inline\b"), required=True, backend="cuda"),
    Rule("torch.nn-layer", "pytorch_wrap", _r(r"torch\.nn\.(?!" + _NN_ALLOWED + ")")),
    Rule("nn-alias-layer", "pytorch_wrap", _r(r"(?<![\w.])nn\.(?!" + _NN_ALLOWED + r")\w+")),
    Rule("torch-op", "torch_computation_ops",
         _r(r"\b(?:" + "|".join(re.escape(f"torch.{op}") for op in _TORCH_OPS) + r")(?=\s*\(|\s|$)")),
    Rule("functional", "torch_computation_ops",
         _r(r"torch\.nn\.functional|\bnn\.functional\.\w+|\bF\.(?:" + _F_OPS + ")")),
    Rule("functional-import", "torch_computation_ops",
         _r(r"from\s+torch\.nn\s+import\s+[^\n]*\bfunctional\b|import\s+torch\.nn\.functional")),
    Rule("streams", "stream_injection", _r(r"(?:torch\.)?cuda\.[Ss]tream\s*\(|with\s+(?:torch\.)?cuda\.stream"
                                           r"|\.wait_stream\s*\(|\.record_stream\s*\(|Stream\(\)")),
    Rule("fp16-downgrade", "precision_downgrade", _r(r"\.half\s*\(|\.float16\s*\(|\.to\s*\(\s*(?:dtype\s*=\s*)?torch\."
                                                    r"(?:float16|half)\b|tl\.astype\s*\(\s*[^,]+,\s*tl\.float16\s*\)")),
)


def strip_comments(code: str, cut_floor_division: bool = True) -> str:
    """Every line cut at its first ``#``, then (as KernelBench does) at its first ``//``, strings included."""
    lines = [line.split("#", 1)[0] for line in code.split("\n")]
    if cut_floor_division:
        lines = [line.split("//", 1)[0] for line in lines]
    return "\n".join(lines)


def check(code: str, backend: str = "triton") -> list[Violation]:
    """Every rule the file breaks under KernelBench's strict settings, by line; ``backend`` picks the requirements."""
    if backend not in ("triton", "cuda"):
        raise ValueError(f"backend={backend!r}; expected 'triton' or 'cuda'")
    kernelbench_view = strip_comments(code)
    hash_only_view = strip_comments(code, cut_floor_division=False)
    found: dict[tuple[str, int], Violation] = {}
    for rule in RULES:
        if rule.backend not in (None, backend):
            continue
        if rule.required:
            if rule.pattern.search(kernelbench_view) is None:
                found[(rule.name, 0)] = Violation(rule.name, rule.category, 0, rule.pattern.pattern)
            continue
        for view in (kernelbench_view, hash_only_view):
            for m in rule.pattern.finditer(view):
                line = view.count("\n", 0, m.start()) + 1
                found.setdefault((rule.name, line), Violation(rule.name, rule.category, line, m.group(0)))
    return sorted(found.values(), key=lambda v: (v.line, v.rule))

