"""A dense reward for the real-model test run: the response's length in characters / 100. Two samples
of one prompt almost never tie, so GRPO advantages (and the update the weight-sync check needs) are
never all zero, unlike an exact-answer reward on a 2-sample group."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 100.0
