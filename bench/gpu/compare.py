import json, sys
import numpy as np, pyarrow.dataset as ds
ref = json.load(open(sys.argv[1])); folder = sys.argv[2]; label = sys.argv[3]
t = ds.dataset(folder, format="parquet").to_table()
ids = t.column("id").to_pylist(); pred = t.column("prediction").to_pylist()
scores = np.array(t.column("scores").to_pylist(), dtype=np.float32)
idx = {k: i for i, k in enumerate(ref["ids"])}
order = [idx[i] for i in ids]
rs = np.array(ref["scores"], dtype=np.float32)[order]; ra = np.array(ref["argmax"])[order]
print(f"{label}: rows {len(ids)} unique {len(set(ids))} of {len(ref['ids'])}; argmax equal {int((np.array(pred)==ra).sum())}; max |score diff| {float(np.abs(scores-rs).max()):.2e}")
