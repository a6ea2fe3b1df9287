#!/bin/bash
tally /app/data.txt | grep -c '^keep ' > /app/count.txt
