"""LidarVerse Space. Placeholder until the app lands (issue 7)."""

if __name__ == "__main__":
    print("LidarVerse: the world-generation app is not built yet; see the open issues.")
