from shardtrain.cli.main import run

run()
