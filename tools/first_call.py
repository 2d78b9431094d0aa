"""First calls from empty caches (GPU): each row a new process, one layer, ``convt3d.conv_transpose3d``
under auto in the default first-call mode ("background").

Rows: every layers-suite geometry at one (dtype, layout), alternating, then ``UNSEEN`` layers drawn by
``tuning_table.draw`` (seed ``SEED``) that no suite holds. Cold: empty convt3d and Triton caches. A row prints cuDNN's
first call (s), convt3d's first call (s), the engine after it, the seconds from the first call until the decision is
final (a call every 0.05 s meanwhile, 90 s at most), the calls made, the final engine ("still-provisional" where 90 s
did not settle it), convt3d's and PyTorch's steady time (µs, CUDA events, median of 15) and the first call's largest
difference from PyTorch's output. Warm: a new process with the caches kept, its first call.

With ``NETWORKS=1`` the rows are the networks suite's networks in each mode instead, a new process each
(``run_networks`` without steady timing): the untouched model's first call (s), the patched one's (s), the extra
and whether the output is within the error budget. ``WARM=0`` leaves out the warm rows.

    OUT=. START=0 UNSEEN=4 SEED=2027 python tools/first_call.py      # writes first_call_bg.json
    OUT=. NETWORKS=1 python tools/first_call.py                      # writes first_call_networks.json
"""
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, "src"); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convt3d.bench.suites import LAYERS
import tuning_table
rows = [(g.name, tuning_table.geometry_spec(g, dtype=["float32", "bfloat16"][i % 2], channels_last=i % 4 >= 2))
        for i, g in enumerate(LAYERS)]
rng = random.Random(int(os.environ.get("SEED", "2027")))
for j in range(int(os.environ.get("UNSEEN", "4"))):
    sp = tuning_table.draw(rng)
    rows.append((f"unseen{j}_{sp['in_channels']}to{sp['out_channels']}_k{sp['kernel_size'][2]}s{sp['stride'][2]}", sp))
CHILD = r'''
import sys, time, torch
import convt3d
from convt3d.dispatch import select
a = {spec!r}
dt = getattr(torch, a["dtype"])
x = torch.randn(a["batch"], a["in_channels"], *a["in_size"], device="cuda", dtype=dt)
w = torch.randn(a["in_channels"], a["out_channels"] // a["groups"], *a["kernel_size"], device="cuda", dtype=dt)
if a["channels_last"]:
    x = x.to(memory_format=torch.channels_last_3d); w = w.to(memory_format=torch.channels_last_3d)
args = (None, a["stride"], a["padding"], a["output_padding"], a["groups"], a["dilation"])
torch.cuda.synchronize(); t1 = time.perf_counter()
y = torch.nn.functional.conv_transpose3d(x, w, *args); torch.cuda.synchronize(); t2 = time.perf_counter()
y2 = convt3d.conv_transpose3d(x, w, *args); torch.cuda.synchronize(); t3 = time.perf_counter()
first_engine = convt3d.explain(x, w, *args).engine
calls, t_final = 1, None
while select._provisional and time.perf_counter() - t3 < 90:
    time.sleep(0.05)
    convt3d.conv_transpose3d(x, w, *args); torch.cuda.synchronize(); calls += 1
t_final = time.perf_counter() - t2
e = convt3d.explain(x, w, *args)
final = e.engine if not select._provisional else "still-provisional"  # explain's pass is not what the calls ran
def us(f):
    for _ in range(3): f()
    s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(15):
        s.record(); f(); t.record(); t.synchronize(); ms.append(s.elapsed_time(t))
    return sorted(ms)[len(ms) // 2] * 1e3
ours = us(lambda: convt3d.conv_transpose3d(x, w, *args)); theirs = us(lambda: torch.nn.functional.conv_transpose3d(x, w, *args))
err = (y2.double() - y.double()).abs().max().item()
print("RESULT", round(t2 - t1, 3), round(t3 - t2, 3), first_engine, round(t_final, 2), calls, final, round(ours, 1), round(theirs, 1), "%.2g" % err)
'''
if os.environ.get("NETWORKS"):
    from convt3d.bench import networks
    rows = [(f"{n.name} {m.label}", (n.name, m.label)) for n in networks.NETWORKS for m in networks.select_modes()]
    CHILD = r'''
import time
from convt3d.bench import networks as N
from convt3d.engines.triton import background
net, label = {spec!r}
found = N.run_networks(N.select_networks([net]), [m for m in N.select_modes() if m.label == label], measure=False)
r = (found[0] or found[1] or found[2])[0]
print("RESULT", *(round(r[k], 2) if k in r else "-" for k in ("torch_first_call_s", "first_call_s", "first_call_extra_s")),
      r.get("within_error_budget", r.get("reason") or r.get("error")), flush=True)
t = time.perf_counter()  # the background compiles finish, so that the warm row finds them in the caches
while background._compiling and time.perf_counter() - t < {wait}:
    time.sleep(0.2)
'''
out = {}
for name, spec in rows[int(os.environ.get("START", "0")):]:
    triton_cache = tempfile.mkdtemp(); c3d_cache = tempfile.mkdtemp()
    for kind in ("cold", "warm")[:1 if os.environ.get("WARM") == "0" else 2]:
        env = dict(os.environ, TRITON_CACHE_DIR=triton_cache, CONVT3D_CACHE_DIR=c3d_cache, CONVT3D_FIRST_CALL="background",
                   PYTHONPATH=os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")]))
        child = CHILD.format(spec=spec, wait=0 if os.environ.get("WARM") == "0" else 100)
        r = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=150)
        line = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
        note = [l[:160] for l in r.stderr.splitlines() if "convt3d:" in l][:1] if not r.returncode else r.stderr.strip().splitlines()[-2:]
        result = line[0][7:] if line else None
        label = f"{name} {spec['dtype']} {'cl' if spec['channels_last'] else 'ncdhw'}" if isinstance(spec, dict) else name
        print(f"{label:46s} {kind}: " + (result or f"rc {r.returncode}"), note, flush=True)
        out[f"{label} {kind}"] = result
        json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "first_call_networks.json" if os.environ.get(
            "NETWORKS") else "first_call_bg.json"), "w"), indent=1)
