"""The Spark jobs, run by `spark-submit` (delaywheel.airflow.spark.spark_job): the checkout's top-level spark/, linked
into the package as delaywheel/spark so that the wheel carries them; files to submit, not modules the library imports; each job imports `sparkjob` (passed to Spark with --py-files) and the library."""
