import os


def test_error_count_written():
  with open("/home/user/logs/app.log") as f:
    want = sum("ERROR" in line for line in f)
  assert want == 3   # two from the task's files, one from its %post
  with open("/home/user/error_count.txt") as f:
    assert f.read().strip() == str(want)


def test_post_ran_in_the_image():
  assert os.access("/opt/logtools/count-errors", os.X_OK)
