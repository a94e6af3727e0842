"""verity's batch engine: every active request is a row of one persistent batch, from its first
prefill chunk to its end (docs/design.md, "The batch engine").

slots: the slot caches and their views (mlx-lm's cache protocol); slotbatch: one model's slots
and forwards; rows: a row's phase and state; select: sampling and verification over a round's
logits; drafts: the draft's proposals and recovery; runner: the round.
"""
