#!/bin/bash
# Harbor verifier: runs the tests and writes the reward file (pytest ships in the image: no
# network is needed here).
if python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
