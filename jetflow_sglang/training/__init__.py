"""Training room: prompt sets and data (`data`), target-written and corpus answers
(`regenerate`), the frozen target's cached features and top-k soft labels (`features`), the
head's trainer (`train`), per-depth metrics beside prompt lookup (`validate`), evaluation
(`evaluate`) and the end-to-end recipe behind the shipped heads (`recipe`)."""
