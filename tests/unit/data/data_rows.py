"""Row builders shared by the data tests (a plain module: conftest.py cannot be imported by name)."""


def make_row(content, *, index=0, ground_truth="##", data_source="ballast/repeat"):
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "repeat",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": "train", "index": index},
    }
