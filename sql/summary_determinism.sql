-- How many repeat runs of the expert-cache evaluation reproduced their first
-- run, over every variant, bonus and prompt: what `moeheal heal` prints under
-- its summary. Only rep > 0 is a repeat; rep 0 is what it is compared with.
-- From: hitrate (rep, same_as_rep0). One row: reps_same, reps_checked.
SELECT
    count(*) FILTER (WHERE rep > 0 AND same_as_rep0) AS reps_same,
    count(*) FILTER (WHERE rep > 0) AS reps_checked
FROM hitrate
