# Task folders (data for tests/envs/images/test_task_images.py), not tests of ours: their test_*.py files
# run inside task sandboxes only.
collect_ignore_glob = ["*"]
