"""What a trial asks of the swarm: ``driver.py`` (MMLU requests through the nodes' HTTP API),
``chat.py`` (chat sessions), ``churn.py`` (nodes that leave and join).
"""
