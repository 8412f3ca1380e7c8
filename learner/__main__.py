from millstream.learner.main import main

main()
