"""The embedded planner's learned policy: a contextual bandit over plan shapes x workers.

- features: the context, hashed word and character n-grams of the query and its task;
- actions: the candidate plans a pool offers (single, verify, k workers then vote);
- learner: Vowpal Wabbit's cb_explore_adf (and two baselines), trained off-policy;
- training: examples from the runs' plans, rewards and traces (what the pipeline produced);
- artifact: the versioned folder `conductor policy train` writes and planning reads;
- planning: the greedy choice and the epsilon-greedy draws, with their propensities.

`conductor.planners.embedded` uses an artifact when one exists for the pool and
falls back to its prior otherwise.
"""
