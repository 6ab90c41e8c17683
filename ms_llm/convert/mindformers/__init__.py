"""MindFormers: its training YAML in every layout (read.py; model.py, data.py, train.py and
pynative.py read the sections), written as r1.x (write.py) or 2.x (write2.py)."""
