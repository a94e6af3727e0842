// Each answer's figures, from the stream's `metrics` object, as chips a user reads.

const ms = (s) => (s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`);

// [metric key, label, value, tooltip] for each figure
export function figures(mx, finish) {
  const joint = mx.drafted > 0;
  const share = joint ? Math.round((100 * mx.accepted) / mx.drafted) : 0;
  return [
    ["tps", "tokens/s", mx.decode_tps.toFixed(1), "decode speed after the first token"],
    ["ttft", "first token", ms(mx.ttft_s), "time to first token, from the worker receiving the request"],
    ["acceptance", "draft accepted", joint ? `${mx.accepted} of ${mx.drafted} (${share}%)` : "—",
      "of the tokens the draft proposed, how many the target kept"],
    ["budget", "drafted per step", joint ? `${mx.budget_mean.toFixed(2)} tokens` : "—",
      "draft tokens the target checked in each verify step (the scheduler's budget)"],
    ["reused", "cache reused", `${mx.reused_tokens} tokens`, "prompt tokens restored from the cache instead of prefilled"],
    ["tokens", "tokens", `${mx.prompt_tokens} in, ${mx.completion_tokens} out`, "prompt tokens, generated tokens"],
    ...(joint ? [["recovery", "rollbacks", `${mx.rollbacks} · ${ms(mx.recovery_s)}`, "steps that rejected a draft token · time to recover state"]] : []),
    ["finish", mx.mode + (mx.draft ? ` · ${mx.draft}` : ""), finish, "mode (draft) and why the answer ended"],
  ];
}
