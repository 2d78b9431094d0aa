"""KernelBench's own harness on the generated files: `eval_kernel_against_ref` of ScalingIntelligence/KernelBench,
each file's ModelNew against its problem's reference Model, default flags, fp32, seed 42.

It measures correctness (KernelBench's verdict at its fp32 tolerance over --trials random inputs) and, with --perf N,
the mean of N CUDA-event timed calls of each model in ms, and speedup = reference / ModelNew. --json writes the
results by file with the versions and date (the record `tools/bench_md.py` reads, beside the printed output saved as a
.log of the same name). Needs a GPU and a KernelBench source checkout (--kb: the folder holding src/kernelbench and
KernelBench/level1, level2). The harness imports LLM client packages its evaluation never calls (dotenv, openai,
litellm, requests, pydantic's BaseModel for its result record); where they are missing, stand-ins take their names.

    python tools/kb_harness.py --kb DIR [--level 1|2] [--ids 58,89] [--loose 3,15] [--trials 5] [--perf 100]
                               [--budget N] [--json FILE]

--loose: problems checked at 1e-2 instead of 1e-4 (the level-2 rule where a normalisation after the convolution
magnifies the reference's own TF32 rounding; `convt3d kernelbench --level 2` shows exact fp32 failing 1e-4 there).

A checkout small enough to carry to a GPU machine (1.3 MB), from a clone of the KernelBench repository:
    git -C KernelBench archive HEAD src/kernelbench KernelBench/level1 KernelBench/level2 | tar -x -C .kb
"""
import argparse
import json
import math
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Warm-up calls before KernelBench times a model: its timing default, which eval_kernel_against_ref does not override.
KB_WARM_UP = 3


def _stand_ins():
    """Names for the harness's unused imports, only where the real package is missing."""
    for name, attrs in {'dotenv': {'load_dotenv': lambda *a, **k: None}, 'openai': {'OpenAI': object}, 'requests': {},
                        'litellm': {'completion': None}, 'tqdm': {'tqdm': lambda it=None, **k: it}}.items():
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.SimpleNamespace(**attrs)
    try:
        import pydantic  # noqa: F401
    except ImportError:
        class BaseModel:
            def __init__(self, **kw):
                for k, v in type(self).__dict__.items():
                    if not k.startswith('_') and not callable(v):
                        setattr(self, k, v.copy() if isinstance(v, dict) else v)
                self.__dict__.update(kw)

            def model_dump(self):
                return dict(self.__dict__)
        sys.modules['pydantic'] = types.SimpleNamespace(BaseModel=BaseModel)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--kb', required=True, help='KernelBench source checkout')
    ap.add_argument('--level', type=int, default=1, choices=(1, 2))
    ap.add_argument('--ids', default='', help='problem ids in this order (default: every generated file)')
    ap.add_argument('--loose', default='', help='problem ids checked at 1e-2 (the normalisation rule)')
    ap.add_argument('--trials', type=int, default=5, help='correctness trials')
    ap.add_argument('--perf', type=int, default=100, help='timed trials (0: correctness only)')
    ap.add_argument('--budget', type=float, default=1e9, help='seconds; files not started by then are left out')
    ap.add_argument('--json', default='', help='write the rows here')
    a = ap.parse_args(argv)
    kb = Path(a.kb).resolve()
    sys.path.insert(0, str(kb / 'src'))
    _stand_ins()
    import kernelbench.eval as kb_eval
    strict = kb_eval.get_tolerance_for_precision

    ours = ROOT / 'kernelbench' / ('level2' if a.level == 2 else '')
    refs = {p.name.split('_')[0]: p for p in (kb / 'KernelBench' / f'level{a.level}').glob('*.py')}
    files = sorted(ours.glob('*.py'), key=lambda p: (int(p.name.split('_')[0]), p.name))
    if a.ids:
        order = a.ids.split(',')
        files = sorted((p for p in files if p.name.split('_')[0] in order),
                       key=lambda p: (order.index(p.name.split('_')[0]), p.name))
    import torch
    import triton
    results, t0 = {}, time.time()
    for p in files:
        if time.time() - t0 > a.budget:
            print(f'{p.name}: left out (budget)', flush=True)
            continue
        pid = p.name.split('_')[0]
        loose = pid in a.loose.split(',')
        kb_eval.get_tolerance_for_precision = (lambda precision: 1e-2) if loose else strict
        r = kb_eval.eval_kernel_against_ref(
            refs[pid].read_text(), p.read_text(), seed_num=42, num_correct_trials=a.trials,
            num_perf_trials=max(a.perf, 1), measure_performance=a.perf > 0, build_dir=f'/tmp/kb_build/{p.stem}',
            backend='cuda' if p.name.endswith('_cuda.py') else 'triton')
        if r is None:
            row = {'compiled': False, 'correctness': False, 'error': 'the harness asked for a retry (lock file)'}
        else:
            row = {'compiled': r.compiled, 'correctness': r.correctness, 'tolerance': 1e-2 if loose else 1e-4,
                   'metadata': {k: str(v) for k, v in r.metadata.items()}}
            if a.perf > 0 and r.correctness:
                row.update(runtime=r.runtime, ref_runtime=r.ref_runtime, speedup=r.ref_runtime / r.runtime)
        results[p.name] = row
        print(p.name, {k: v for k, v in row.items() if k != 'metadata'}, flush=True)
    timed = [r['speedup'] for r in results.values() if 'speedup' in r]
    if timed:
        print(f'correct {sum(r["correctness"] for r in results.values())} of {len(results)}; '
              f'geomean of {len(timed)} timed: {math.exp(sum(map(math.log, timed)) / len(timed)):.2f}x')
    if a.json:
        v = torch.backends.cudnn.version()  # e.g. 91900 for 9.19.0
        results['environment'] = {'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__,
                                  'triton': triton.__version__, 'cudnn': f'{v // 10000}.{v // 100 % 100}.{v % 100}',
                                  'date': time.strftime('%Y-%m-%d', time.gmtime()), 'precision': 'tf32',
                                  'level': a.level, 'correctness_trials': a.trials, 'warm_up': KB_WARM_UP,
                                  'timed_trials': a.perf, 'timing_method': 'cuda_event'}
        Path(a.json).write_text(json.dumps(results, indent=1))

if __name__ == '__main__':
    main()
