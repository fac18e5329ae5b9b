"""The tool task's held-out score WITHOUT the tool: SmolLM2-135M-Instruct (HF, greedy, 48 new tokens)
asked each held-out question with a system prompt that only asks for "Answer: <number>", scored by
the task's own reward. Shows that the task cannot be passed in the model's head.

    python benchmarks/tool_arithmetic_no_tool.py .cache/data/tool_arithmetic/val.parquet out.json
"""
import json, sys, torch, pyarrow.parquet as pq
from transformers import AutoModelForCausalLM, AutoTokenizer
from ballast.models.from_gguf import real_model_dir
from ballast.data.tool_arithmetic import tool_arithmetic_score
torch.set_num_threads(1)
m = str(real_model_dir("float32")); tok = AutoTokenizer.from_pretrained(m)
model = AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
rows = pq.read_table(sys.argv[1]).to_pylist()
score, out = 0.0, []
for r in rows:
    q = r["prompt"][-1]["content"]
    msgs = [{"role": "system", "content": "You are a helpful assistant. Give the final answer as: Answer: <number>"},
            {"role": "user", "content": q}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor): ids = ids["input_ids"]
    with torch.no_grad():
        g = model.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=tok.eos_token_id)
    text = tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True)
    s = tool_arithmetic_score("ballast/tool_arithmetic", text, r["reward_model"]["ground_truth"])
    s = s["score"] if isinstance(s, dict) else s
    score += s; out.append({"q": q, "truth": r["reward_model"]["ground_truth"], "response": text, "score": s})
res = {"questions": len(rows), "score_mean": score / len(rows), "answers": out}
json.dump(res, open(sys.argv[2], "w"), indent=1)
print("no-tool held-out score", res["score_mean"], "of", len(rows)); print(out[0]); print(out[1])
