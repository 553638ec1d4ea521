"""The reward-hacking corpus: environments, cheating strategies and honest solutions that
bench/reward_hacking.py and tests/integration/test_reward_hacking.py run against the real grader."""
