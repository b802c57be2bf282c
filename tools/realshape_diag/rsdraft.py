# Scratch scripts of the 2026-12-02 CPU diagnosis (docs/realshape-oracle-diagnosis.md); they write under /tmp/dd.
import json
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from speclab.fixtures import realshape as R

big = Path("/tmp/dd/bigtarget"); fake = Path("/tmp/dd/fake_dsv4"); fake.mkdir(exist_ok=True)
(fake / "config.json").write_text((big / "config.json").read_text())
ts = load_file(str(big / "model.safetensors"))
save_file({"embed.weight": ts["model.embed_tokens.weight"].contiguous(), "norm.weight": ts["model.norm.weight"].contiguous()}, str(fake / R.EMBED_SHARD))
params = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
m = R.build_realshape_dsv4_eagle3(Path(sys.argv[1]), fake, seed=0, **params)
print({k: v for k, v in m.items() if k != "tensors"})
